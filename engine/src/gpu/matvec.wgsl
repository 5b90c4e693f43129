// The products of f32, f16 and bf16 matrices (with f32 x) and of GGUF's
// formats of 32-value blocks (lane k takes every 8th block of the row):
// - Q8_0: an f16 scale d, then 32 int8 q: d q;
// - Q4_0: d, then 16 bytes, value j in byte j's low nibble and value
//   j + 16 in its high one: d (q - 8);
// - Q4_1: d, an f16 minimum m, then Q4_0's nibbles: d q + m;
// - Q5_0: d, 32 high bits (bit j: value j's fifth bit), Q4_0's nibbles:
//   d (q - 16);
// - Q5_1: d, m, the high bits, the nibbles: d q + m.
// Their x is rounded to 8-bit blocks first (`quantize_q8`), as llama.cpp
// and the CPU engine do: per block 8 words of i8, a scale dx and dx sum(q),
// both through f16. A block's dot product is then an exact integer, and a
// row is sum(int * d * dx) (+ m * dx sum(q) for Q4_1 and Q5_1), the CPU's
// arithmetic in another order across blocks.

@compute @workgroup_size(64)
fn matvec_f32(@builtin(workgroup_id) group: vec3<u32>,
              @builtin(num_workgroups) count: vec3<u32>,
              @builtin(local_invocation_index) thread: u32) {
    let row = row_of(group, count, thread);
    let xs = x_row(group.z) * shape.cols;
    var sum = 0.0;
    if (row < shape.rows) {
        let start = w_row(group.z, row) * shape.cols;
        for (var c = thread % LANES; c < shape.cols; c = c + LANES) {
            sum = sum + bitcast<f32>(weights[start + c]) * x[xs + c];
        }
    }
    finish(row, group.z, thread, sum);
}

// An f16 or bf16 matrix: two values a word (the columns are even), lane k
// takes every 8th word of the row.
fn float_pairs_dot(group: vec3<u32>, row: u32, thread: u32, bf16: bool) -> f32 {
    var sum = 0.0;
    if (row < shape.rows) {
        let pairs = shape.cols / 2u;
        let start = w_row(group.z, row) * pairs;
        let xs = x_row(group.z) * shape.cols;
        for (var p = thread % LANES; p < pairs; p = p + LANES) {
            let word = weights[start + p];
            var w: vec2<f32>;
            if (bf16) {
                w = vec2<f32>(bitcast<f32>(word << 16u), bitcast<f32>(word & 0xffff0000u));
            } else {
                w = unpack2x16float(word);
            }
            sum = sum + w.x * x[xs + 2u * p] + w.y * x[xs + 2u * p + 1u];
        }
    }
    return sum;
}

@compute @workgroup_size(64)
fn matvec_f16(@builtin(workgroup_id) group: vec3<u32>,
              @builtin(num_workgroups) count: vec3<u32>,
              @builtin(local_invocation_index) thread: u32) {
    let row = row_of(group, count, thread);
    finish(row, group.z, thread, float_pairs_dot(group, row, thread, false));
}

@compute @workgroup_size(64)
fn matvec_bf16(@builtin(workgroup_id) group: vec3<u32>,
               @builtin(num_workgroups) count: vec3<u32>,
               @builtin(local_invocation_index) thread: u32) {
    let row = row_of(group, count, thread);
    finish(row, group.z, thread, float_pairs_dot(group, row, thread, true));
}

// The integer dot product of 16 bytes of nibbles at byte `offset` (value
// j in byte j's low nibble, j + 16 in its high one) with the 8-bit block
// at word `xb`. Packed 8-bit dot products where the adapter has them
// (naga writes the plain arithmetic where it has not).
fn nibble_dot(offset: u32, xb: u32) -> i32 {
    var acc = 0;
    for (var w = 0u; w < 4u; w = w + 1u) {
        let nibbles = word_at(offset + 4u * w);
        acc = acc + dot4I8Packed(nibbles & LOW_NIBBLES, xq[xb + w])
            + dot4I8Packed((nibbles >> 4u) & LOW_NIBBLES, xq[xb + 4u + w]);
    }
    return acc;
}

// The sum of the 8-bit block at word `xb`.
fn xq_total(xb: u32) -> i32 {
    var total = 0;
    for (var w = 0u; w < 8u; w = w + 1u) {
        total = total + dot4I8Packed(0x01010101u, xq[xb + w]);
    }
    return total;
}

@compute @workgroup_size(64)
fn matvec_q8_0(@builtin(workgroup_id) group: vec3<u32>,
               @builtin(num_workgroups) count: vec3<u32>,
               @builtin(local_invocation_index) thread: u32) {
    let row = row_of(group, count, thread);
    let blocks = shape.cols / 32u;
    var sum = 0.0;
    if (row < shape.rows) {
        for (var b = thread % LANES; b < blocks; b = b + LANES) {
            let at = (w_row(group.z, row) * blocks + b) * 34u;
            let xb = (x_row(group.z) * blocks + b) * Q8_WORDS;
            var acc = 0;
            for (var w = 0u; w < 8u; w = w + 1u) {
                acc = acc + dot4I8Packed(word_at(at + 2u + 4u * w), xq[xb + w]);
            }
            sum = sum + f32(acc) * (f16_at(at) * xq_scale(xb));
        }
    }
    finish(row, group.z, thread, sum);
}

@compute @workgroup_size(64)
fn matvec_q4_0(@builtin(workgroup_id) group: vec3<u32>,
               @builtin(num_workgroups) count: vec3<u32>,
               @builtin(local_invocation_index) thread: u32) {
    let row = row_of(group, count, thread);
    let blocks = shape.cols / 32u;
    var sum = 0.0;
    if (row < shape.rows) {
        for (var b = thread % LANES; b < blocks; b = b + LANES) {
            let at = (w_row(group.z, row) * blocks + b) * 18u;
            let xb = (x_row(group.z) * blocks + b) * Q8_WORDS;
            // sum (q - 8) x = sum q x - 8 sum x, exactly, in integers.
            let acc = nibble_dot(at + 2u, xb) - 8 * xq_total(xb);
            sum = sum + f32(acc) * (f16_at(at) * xq_scale(xb));
        }
    }
    finish(row, group.z, thread, sum);
}

@compute @workgroup_size(64)
fn matvec_q4_1(@builtin(workgroup_id) group: vec3<u32>,
               @builtin(num_workgroups) count: vec3<u32>,
               @builtin(local_invocation_index) thread: u32) {
    let row = row_of(group, count, thread);
    let blocks = shape.cols / 32u;
    var sum = 0.0;
    var mins = 0.0;
    if (row < shape.rows) {
        for (var b = thread % LANES; b < blocks; b = b + LANES) {
            let at = (w_row(group.z, row) * blocks + b) * 20u;
            let xb = (x_row(group.z) * blocks + b) * Q8_WORDS;
            // Blocks of 20 bytes start on a word: d and m are one word.
            let scales = unpack2x16float(weights[at >> 2u]);
            sum = sum + f32(nibble_dot(at + 4u, xb)) * (scales.x * xq_scale(xb));
            mins = mins + scales.y * xq_sum(xb);
        }
    }
    finish(row, group.z, thread, sum + mins);
}

// Bits `first..first + 4` of `bits`, each moved to bit 4 of its own byte:
// the fifth bits of four values.
fn fifth_bits(bits: u32, first: u32) -> u32 {
    let b = bits >> first;
    return ((b & 1u) | ((b & 2u) << 7u) | ((b & 4u) << 14u) | ((b & 8u) << 21u)) << 4u;
}

// The integer dot product of a 5-bit block (nibbles at byte `offset`,
// fifth bits `high`) with the 8-bit block at word `xb`, values unsigned.
fn five_bit_dot(offset: u32, high: u32, xb: u32) -> i32 {
    var acc = 0;
    for (var w = 0u; w < 4u; w = w + 1u) {
        let nibbles = word_at(offset + 4u * w);
        let low = (nibbles & LOW_NIBBLES) | fifth_bits(high, 4u * w);
        let top = ((nibbles >> 4u) & LOW_NIBBLES) | fifth_bits(high, 16u + 4u * w);
        acc = acc + dot4I8Packed(low, xq[xb + w]) + dot4I8Packed(top, xq[xb + 4u + w]);
    }
    return acc;
}

@compute @workgroup_size(64)
fn matvec_q5_0(@builtin(workgroup_id) group: vec3<u32>,
               @builtin(num_workgroups) count: vec3<u32>,
               @builtin(local_invocation_index) thread: u32) {
    let row = row_of(group, count, thread);
    let blocks = shape.cols / 32u;
    var sum = 0.0;
    if (row < shape.rows) {
        for (var b = thread % LANES; b < blocks; b = b + LANES) {
            let at = (w_row(group.z, row) * blocks + b) * 22u;
            let xb = (x_row(group.z) * blocks + b) * Q8_WORDS;
            // sum (q - 16) x = sum q x - 16 sum x, exactly.
            let acc = five_bit_dot(at + 6u, word_at(at + 2u), xb) - 16 * xq_total(xb);
            sum = sum + f32(acc) * (f16_at(at) * xq_scale(xb));
        }
    }
    finish(row, group.z, thread, sum);
}

@compute @workgroup_size(64)
fn matvec_q5_1(@builtin(workgroup_id) group: vec3<u32>,
               @builtin(num_workgroups) count: vec3<u32>,
               @builtin(local_invocation_index) thread: u32) {
    let row = row_of(group, count, thread);
    let blocks = shape.cols / 32u;
    var sum = 0.0;
    var mins = 0.0;
    if (row < shape.rows) {
        for (var b = thread % LANES; b < blocks; b = b + LANES) {
            // Blocks of 24 bytes start on a word: d and m, the high bits,
            // then the nibbles.
            let at = (w_row(group.z, row) * blocks + b) * 24u;
            let xb = (x_row(group.z) * blocks + b) * Q8_WORDS;
            let scales = unpack2x16float(weights[at >> 2u]);
            let acc = five_bit_dot(at + 8u, weights[(at >> 2u) + 1u], xb);
            sum = sum + f32(acc) * (scales.x * xq_scale(xb));
            mins = mins + scales.y * xq_sum(xb);
        }
    }
    finish(row, group.z, thread, sum + mins);
}

fn round_f16(value: f32) -> f32 {
    return unpack2x16float(pack2x16float(vec2<f32>(value, 0.0))).x;
}

// x's 32-value blocks to 8 bits, one thread per block (all tokens' blocks
// in a row: the columns are a multiple of 32). `shape.rows` is the number
// of blocks.
@compute @workgroup_size(64)
fn quantize_q8(@builtin(workgroup_id) group: vec3<u32>,
               @builtin(num_workgroups) count: vec3<u32>,
               @builtin(local_invocation_index) thread: u32) {
    let block = (group.y * count.x + group.x) * THREADS + thread;
    if (block >= shape.rows) {
        return;
    }
    let start = block * 32u;
    var amax = 0.0;
    for (var j = 0u; j < 32u; j = j + 1u) {
        amax = max(amax, abs(x[start + j]));
    }
    let d = amax / 127.0;
    var id = 0.0;
    if (amax != 0.0) {
        id = 127.0 / amax;
    }
    var sum = 0;
    for (var k = 0u; k < 8u; k = k + 1u) {
        var word = 0u;
        for (var j = 0u; j < 4u; j = j + 1u) {
            let q = i32(round(x[start + 4u * k + j] * id));
            sum = sum + q;
            word = word | ((bitcast<u32>(q) & 0xffu) << (8u * j));
        }
        y_q[block * Q8_WORDS + k] = word;
    }
    y_q[block * Q8_WORDS + 8u] = bitcast<u32>(round_f16(d));
    y_q[block * Q8_WORDS + 9u] = bitcast<u32>(round_f16(d * f32(sum)));
}
