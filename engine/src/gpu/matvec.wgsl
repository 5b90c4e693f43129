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

// Each kernel reads a block of W's row once into registers, then takes
// its product with each of the tile's rows of x.

@compute @workgroup_size(64)
fn matvec_f32(@builtin(workgroup_id) group: vec3<u32>,
              @builtin(num_workgroups) count: vec3<u32>,
              @builtin(local_invocation_index) thread: u32) {
    let row = row_of(group, count, thread);
    let first = first_of(group);
    var sums: array<f32, TOKENS>;
    if (row < shape.rows) {
        let start = w_row(first, row) * shape.cols;
        for (var c = thread % LANES; c < shape.cols; c = c + LANES) {
            let w = bitcast<f32>(weights[start + c]);
            for (var t = 0u; t < TOKENS; t = t + 1u) {
                if (has(first, t)) {
                    sums[t] = sums[t] + w * x[x_row(first + t) * shape.cols + c];
                }
            }
        }
    }
    finish_tile(row, first, thread, sums);
}

// An f16 or bf16 matrix: two values a word (the columns are even), lane k
// takes every 8th word of the row.
fn float_pairs_dot(first: u32, row: u32, thread: u32, bf16: bool) -> array<f32, TOKENS> {
    var sums: array<f32, TOKENS>;
    if (row >= shape.rows) {
        return sums;
    }
    let pairs = shape.cols / 2u;
    let start = w_row(first, row) * pairs;
    for (var p = thread % LANES; p < pairs; p = p + LANES) {
        let word = weights[start + p];
        var w: vec2<f32>;
        if (bf16) {
            w = vec2<f32>(bitcast<f32>(word << 16u), bitcast<f32>(word & 0xffff0000u));
        } else {
            w = unpack2x16float(word);
        }
        for (var t = 0u; t < TOKENS; t = t + 1u) {
            if (has(first, t)) {
                let xs = x_row(first + t) * shape.cols + 2u * p;
                sums[t] = sums[t] + w.x * x[xs] + w.y * x[xs + 1u];
            }
        }
    }
    return sums;
}

@compute @workgroup_size(64)
fn matvec_f16(@builtin(workgroup_id) group: vec3<u32>,
              @builtin(num_workgroups) count: vec3<u32>,
              @builtin(local_invocation_index) thread: u32) {
    let row = row_of(group, count, thread);
    let first = first_of(group);
    finish_tile(row, first, thread, float_pairs_dot(first, row, thread, false));
}

@compute @workgroup_size(64)
fn matvec_bf16(@builtin(workgroup_id) group: vec3<u32>,
               @builtin(num_workgroups) count: vec3<u32>,
               @builtin(local_invocation_index) thread: u32) {
    let row = row_of(group, count, thread);
    let first = first_of(group);
    finish_tile(row, first, thread, float_pairs_dot(first, row, thread, true));
}

// A block of W's 32 values as 8 words of bytes (values 4w..4w+3 in word
// w), from 16 bytes of nibbles at byte `offset` (value j in byte j's low
// nibble, j + 16 in its high one).
fn nibble_words(offset: u32) -> array<u32, 8> {
    var q: array<u32, 8>;
    for (var w = 0u; w < 4u; w = w + 1u) {
        let nibbles = word_at(offset + 4u * w);
        q[w] = nibbles & LOW_NIBBLES;
        q[w + 4u] = (nibbles >> 4u) & LOW_NIBBLES;
    }
    return q;
}

// The exact integer dot product of a block's 8 words of bytes with the
// 8-bit block of x at word `xb`. Packed 8-bit dot products where the
// adapter has them (naga writes the plain arithmetic where it has not).
fn block_dot(q: array<u32, 8>, xb: u32) -> i32 {
    var acc = 0;
    for (var w = 0u; w < 8u; w = w + 1u) {
        acc = acc + dot4I8Packed(q[w], xq[xb + w]);
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

// The word of x's 8-bit blocks where product row z's block b starts.
fn x_block(z: u32, blocks: u32, b: u32) -> u32 {
    return (x_row(z) * blocks + b) * Q8_WORDS;
}

// A format of 32-value blocks whose values are d (q - offset): `width`
// bytes a block, d first (Q8_0, Q4_0, Q5_0).
fn offset_blocks(first: u32, row: u32, lane: u32, width: u32, offset: i32) -> array<f32, TOKENS> {
    var sums: array<f32, TOKENS>;
    if (row >= shape.rows) {
        return sums;
    }
    let blocks = shape.cols / 32u;
    for (var b = lane; b < blocks; b = b + LANES) {
        let at = (w_row(first, row) * blocks + b) * width;
        var q: array<u32, 8>;
        if (width == 34u) {
            for (var w = 0u; w < 8u; w = w + 1u) {
                q[w] = word_at(at + 2u + 4u * w);
            }
        } else if (width == 18u) {
            q = nibble_words(at + 2u);
        } else {
            q = five_bit_words(at + 6u, word_at(at + 2u));
        }
        let d = f16_at(at);
        for (var t = 0u; t < TOKENS; t = t + 1u) {
            if (has(first, t)) {
                let xb = x_block(first + t, blocks, b);
                // sum (q - o) x = sum q x - o sum x, exactly, in integers.
                var acc = block_dot(q, xb);
                if (offset != 0) {
                    acc = acc - offset * xq_total(xb);
                }
                sums[t] = sums[t] + f32(acc) * (d * xq_scale(xb));
            }
        }
    }
    return sums;
}

// A format of 32-value blocks whose values are d q + m: `width` bytes a
// block starting on a word, d and m its first word (Q4_1, Q5_1).
fn minimum_blocks(first: u32, row: u32, lane: u32, width: u32) -> array<f32, TOKENS> {
    var sums: array<f32, TOKENS>;
    var mins: array<f32, TOKENS>;
    if (row < shape.rows) {
        let blocks = shape.cols / 32u;
        for (var b = lane; b < blocks; b = b + LANES) {
            let at = (w_row(first, row) * blocks + b) * width;
            let scales = unpack2x16float(weights[at >> 2u]);
            var q: array<u32, 8>;
            if (width == 20u) {
                q = nibble_words(at + 4u);
            } else {
                // The high bits, then the nibbles.
                q = five_bit_words(at + 8u, weights[(at >> 2u) + 1u]);
            }
            for (var t = 0u; t < TOKENS; t = t + 1u) {
                if (has(first, t)) {
                    let xb = x_block(first + t, blocks, b);
                    sums[t] = sums[t] + f32(block_dot(q, xb)) * (scales.x * xq_scale(xb));
                    mins[t] = mins[t] + scales.y * xq_sum(xb);
                }
            }
        }
    }
    for (var t = 0u; t < TOKENS; t = t + 1u) {
        sums[t] = sums[t] + mins[t];
    }
    return sums;
}

@compute @workgroup_size(64)
fn matvec_q8_0(@builtin(workgroup_id) group: vec3<u32>,
               @builtin(num_workgroups) count: vec3<u32>,
               @builtin(local_invocation_index) thread: u32) {
    let row = row_of(group, count, thread);
    let first = first_of(group);
    finish_tile(row, first, thread, offset_blocks(first, row, thread % LANES, 34u, 0));
}

@compute @workgroup_size(64)
fn matvec_q4_0(@builtin(workgroup_id) group: vec3<u32>,
               @builtin(num_workgroups) count: vec3<u32>,
               @builtin(local_invocation_index) thread: u32) {
    let row = row_of(group, count, thread);
    let first = first_of(group);
    finish_tile(row, first, thread, offset_blocks(first, row, thread % LANES, 18u, 8));
}

@compute @workgroup_size(64)
fn matvec_q4_1(@builtin(workgroup_id) group: vec3<u32>,
               @builtin(num_workgroups) count: vec3<u32>,
               @builtin(local_invocation_index) thread: u32) {
    let row = row_of(group, count, thread);
    let first = first_of(group);
    finish_tile(row, first, thread, minimum_blocks(first, row, thread % LANES, 20u));
}

// Bits `first..first + 4` of `bits`, each moved to bit 4 of its own byte:
// the fifth bits of four values.
fn fifth_bits(bits: u32, first: u32) -> u32 {
    let b = bits >> first;
    return ((b & 1u) | ((b & 2u) << 7u) | ((b & 4u) << 14u) | ((b & 8u) << 21u)) << 4u;
}

// A 5-bit block (nibbles at byte `offset`, fifth bits `high`) as 8 words
// of bytes, values unsigned.
fn five_bit_words(offset: u32, high: u32) -> array<u32, 8> {
    var q = nibble_words(offset);
    for (var w = 0u; w < 4u; w = w + 1u) {
        q[w] = q[w] | fifth_bits(high, 4u * w);
        q[w + 4u] = q[w + 4u] | fifth_bits(high, 16u + 4u * w);
    }
    return q;
}

@compute @workgroup_size(64)
fn matvec_q5_0(@builtin(workgroup_id) group: vec3<u32>,
               @builtin(num_workgroups) count: vec3<u32>,
               @builtin(local_invocation_index) thread: u32) {
    let row = row_of(group, count, thread);
    let first = first_of(group);
    finish_tile(row, first, thread, offset_blocks(first, row, thread % LANES, 22u, 16));
}

@compute @workgroup_size(64)
fn matvec_q5_1(@builtin(workgroup_id) group: vec3<u32>,
               @builtin(num_workgroups) count: vec3<u32>,
               @builtin(local_invocation_index) thread: u32) {
    let row = row_of(group, count, thread);
    let first = first_of(group);
    finish_tile(row, first, thread, minimum_blocks(first, row, thread % LANES, 24u));
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
