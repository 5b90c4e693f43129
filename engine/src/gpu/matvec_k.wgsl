// The products of GGUF's K-quant formats (super-blocks of 256 values with
// a scale per sub-block) with x rounded to 256-value 8-bit blocks
// (`quantize_q8k`, llama.cpp's Q8_K: per block 64 words of i8, the f32
// scale, and the sums of each 16 values as 16 i32 words).
//
// The 8 lanes of a row take one super-block together, lane k its values
// 32k..32k+32: 8 words of W's bits and 8 words of x. The sub-block
// scales multiply exact integer dot products, and minimums (or the offsets
// of Q6_K and Q3_K) come from x's sums by 16, as on the CPU; each lane
// then adds its share times the super-block's f32 scales.
// - Q4_K (144 bytes): f16 d and dmin, 12 bytes of 6-bit scales and
//   minimums, 128 bytes of nibbles: d sc q - dmin m;
// - Q5_K (176 bytes): as Q4_K with 32 bytes of fifth bits before the
//   nibbles;
// - Q6_K (210 bytes): 128 bytes of low nibbles, 64 of high pairs, 16 i8
//   scales (one per 16 values), f16 d: d sc (q - 32);
// - Q2_K (84 bytes): 16 bytes of 4-bit scale and minimum, 64 bytes of
//   2-bit values, f16 d and dmin: d sc q - dmin m;
// - Q3_K (110 bytes): 32 bytes of third bits, 64 of 2-bit values, 12 of
//   6-bit scales, f16 d: d (sc - 32) (q - 4).

const Q8K_WORDS: u32 = 81u;
const Q8K_SCALE: u32 = 64u;
const Q8K_SUMS: u32 = 65u;

fn q8k_scale(xb: u32) -> f32 {
    return bitcast<f32>(xq[xb + Q8K_SCALE]);
}

// The sum of x's values 16g..16g+16 of the block at word `xb`.
fn q8k_sum(xb: u32, g: u32) -> i32 {
    return bitcast<i32>(xq[xb + Q8K_SUMS + g]);
}

// Lane k's integer dot of 16 values (4 words of W's bits from `bits`,
// already as bytes) with x's words from `xw`.
fn dot16(bits: array<u32, 8>, first: u32, xw: u32) -> i32 {
    var acc = 0;
    for (var w = 0u; w < 4u; w = w + 1u) {
        acc = acc + dot4I8Packed(bits[first + w], xq[xw + w]);
    }
    return acc;
}

// The 6-bit scale (`minimum` false) or minimum of sub-block k of a Q4_K
// or Q5_K super-block whose 12 packed bytes start at byte `at`
// (llama.cpp's get_scale_min_k4).
fn k4_scale(at: u32, k: u32, minimum: bool) -> u32 {
    let m = select(0u, 4u, minimum);
    if (k < 4u) {
        return byte_at(at + k + m) & 63u;
    }
    let low = (byte_at(at + k + 4u) >> (m)) & 0x0fu;
    return low | ((byte_at(at + k - 4u + m) >> 6u) << 4u);
}

// The word of x's 8-bit blocks of 256 where product row z's block b
// starts.
fn xk_block(z: u32, blocks: u32, b: u32) -> u32 {
    return (x_row(z) * blocks + b) * Q8K_WORDS;
}

// Each kernel reads its lane's share of a super-block of W once (`bits`
// and the scales), then takes its product with each of the tile's rows of
// x.

// Q4_K and Q5_K: `width` bytes a super-block, fifth bits or not.
fn k4_row(first: u32, row: u32, lane: u32, width: u32, fifth: bool) -> array<f32, TOKENS> {
    let blocks = shape.cols / 256u;
    var sums: array<f32, TOKENS>;
    var mins: array<f32, TOKENS>;
    let nibbles_at = select(16u, 48u, fifth);
    for (var b = 0u; b < blocks; b = b + 1u) {
        let at = (w_row(first, row) * blocks + b) * width;
        var bits: array<u32, 8>;
        let shift = 4u * (lane % 2u);
        for (var w = 0u; w < 8u; w = w + 1u) {
            let nibbles = word_at(at + nibbles_at + 32u * (lane / 2u) + 4u * w);
            bits[w] = (nibbles >> shift) & LOW_NIBBLES;
            if (fifth) {
                bits[w] = bits[w] | (((word_at(at + 16u + 4u * w) >> lane) & 0x01010101u) << 4u);
            }
        }
        let scale = i32(k4_scale(at + 4u, lane, false));
        let minimum = i32(k4_scale(at + 4u, lane, true));
        let d = f16_at(at);
        let dmin = f16_at(at + 2u);
        for (var t = 0u; t < TOKENS; t = t + 1u) {
            if (has(first, t)) {
                let xb = xk_block(first + t, blocks, b);
                let dot = dot16(bits, 0u, xb + 8u * lane) + dot16(bits, 4u, xb + 8u * lane + 4u);
                let x_sum = q8k_sum(xb, 2u * lane) + q8k_sum(xb, 2u * lane + 1u);
                let dx = q8k_scale(xb);
                sums[t] = sums[t] + f32(scale * dot) * (d * dx);
                mins[t] = mins[t] + f32(minimum * x_sum) * (dmin * dx);
            }
        }
    }
    for (var t = 0u; t < TOKENS; t = t + 1u) {
        sums[t] = sums[t] - mins[t];
    }
    return sums;
}

@compute @workgroup_size(64)
fn matvec_q4_k(@builtin(workgroup_id) group: vec3<u32>,
               @builtin(num_workgroups) count: vec3<u32>,
               @builtin(local_invocation_index) thread: u32) {
    let row = row_of(group, count, thread);
    let first = first_of(group);
    var sums: array<f32, TOKENS>;
    if (row < shape.rows) {
        sums = k4_row(first, row, thread % LANES, 144u, false);
    }
    finish_tile(row, first, thread, sums);
}

@compute @workgroup_size(64)
fn matvec_q5_k(@builtin(workgroup_id) group: vec3<u32>,
               @builtin(num_workgroups) count: vec3<u32>,
               @builtin(local_invocation_index) thread: u32) {
    let row = row_of(group, count, thread);
    let first = first_of(group);
    var sums: array<f32, TOKENS>;
    if (row < shape.rows) {
        sums = k4_row(first, row, thread % LANES, 176u, true);
    }
    finish_tile(row, first, thread, sums);
}

fn i8_at(offset: u32) -> i32 {
    return (bitcast<i32>(byte_at(offset) << 24u)) >> 24u;
}

@compute @workgroup_size(64)
fn matvec_q6_k(@builtin(workgroup_id) group: vec3<u32>,
               @builtin(num_workgroups) count: vec3<u32>,
               @builtin(local_invocation_index) thread: u32) {
    let row = row_of(group, count, thread);
    let first = first_of(group);
    let lane = thread % LANES;
    let blocks = shape.cols / 256u;
    var sums: array<f32, TOKENS>;
    if (row < shape.rows) {
        // Lane k: values 128 half + 32 quarter + l.
        let half = lane / 4u;
        let quarter = lane % 4u;
        let low_at = 64u * half + 32u * (quarter % 2u);
        let low_shift = 4u * (quarter / 2u);
        let g = 2u * lane;
        for (var b = 0u; b < blocks; b = b + 1u) {
            let at = (w_row(first, row) * blocks + b) * 210u;
            var bits: array<u32, 8>;
            for (var w = 0u; w < 8u; w = w + 1u) {
                let low = (word_at(at + low_at + 4u * w) >> low_shift) & LOW_NIBBLES;
                let high = (word_at(at + 128u + 32u * half + 4u * w) >> (2u * quarter)) & 0x03030303u;
                bits[w] = low | (high << 4u);
            }
            let scales = vec2<i32>(i8_at(at + 192u + g), i8_at(at + 193u + g));
            let d = f16_at(at + 208u);
            for (var t = 0u; t < TOKENS; t = t + 1u) {
                if (has(first, t)) {
                    let xb = xk_block(first + t, blocks, b);
                    // sum (q - 32) x = sum q x - 32 sum x, per group of 16.
                    let one = dot16(bits, 0u, xb + 8u * lane) - 32 * q8k_sum(xb, g);
                    let two = dot16(bits, 4u, xb + 8u * lane + 4u) - 32 * q8k_sum(xb, g + 1u);
                    let acc = scales.x * one + scales.y * two;
                    sums[t] = sums[t] + f32(acc) * (d * q8k_scale(xb));
                }
            }
        }
    }
    finish_tile(row, first, thread, sums);
}

@compute @workgroup_size(64)
fn matvec_q2_k(@builtin(workgroup_id) group: vec3<u32>,
               @builtin(num_workgroups) count: vec3<u32>,
               @builtin(local_invocation_index) thread: u32) {
    let row = row_of(group, count, thread);
    let first = first_of(group);
    let lane = thread % LANES;
    let blocks = shape.cols / 256u;
    var sums: array<f32, TOKENS>;
    var mins: array<f32, TOKENS>;
    if (row < shape.rows) {
        let pairs_at = 16u + 32u * (lane / 4u);
        let shift = 2u * (lane % 4u);
        let g = 2u * lane;
        for (var b = 0u; b < blocks; b = b + 1u) {
            let at = (w_row(first, row) * blocks + b) * 84u;
            var bits: array<u32, 8>;
            for (var w = 0u; w < 8u; w = w + 1u) {
                bits[w] = (weights[(at + pairs_at) / 4u + w] >> shift) & 0x03030303u;
            }
            let one = byte_at(at + g);
            let two = byte_at(at + g + 1u);
            let d = f16_at(at + 80u);
            let dmin = f16_at(at + 82u);
            for (var t = 0u; t < TOKENS; t = t + 1u) {
                if (has(first, t)) {
                    let xb = xk_block(first + t, blocks, b);
                    let acc = i32(one & 15u) * dot16(bits, 0u, xb + 8u * lane)
                        + i32(two & 15u) * dot16(bits, 4u, xb + 8u * lane + 4u);
                    let min_acc = i32(one >> 4u) * q8k_sum(xb, g)
                        + i32(two >> 4u) * q8k_sum(xb, g + 1u);
                    let dx = q8k_scale(xb);
                    sums[t] = sums[t] + f32(acc) * (d * dx);
                    mins[t] = mins[t] + f32(min_acc) * (dmin * dx);
                }
            }
        }
    }
    for (var t = 0u; t < TOKENS; t = t + 1u) {
        sums[t] = sums[t] - mins[t];
    }
    finish_tile(row, first, thread, sums);
}

// Scale k of a Q3_K super-block, its 12 packed bytes at `at`, less 32.
fn q3_scale(at: u32, k: u32) -> i32 {
    var low = byte_at(at + k % 8u);
    if (k >= 8u) {
        low = low >> 4u;
    }
    let high = (byte_at(at + 8u + k % 4u) >> (2u * (k / 4u))) & 3u;
    return i32((low & 15u) | (high << 4u)) - 32;
}

@compute @workgroup_size(64)
fn matvec_q3_k(@builtin(workgroup_id) group: vec3<u32>,
               @builtin(num_workgroups) count: vec3<u32>,
               @builtin(local_invocation_index) thread: u32) {
    let row = row_of(group, count, thread);
    let first = first_of(group);
    let lane = thread % LANES;
    let blocks = shape.cols / 256u;
    var sums: array<f32, TOKENS>;
    if (row < shape.rows) {
        let half = lane / 4u;
        let pair = lane % 4u;
        let g = 2u * lane;
        for (var b = 0u; b < blocks; b = b + 1u) {
            let at = (w_row(first, row) * blocks + b) * 110u;
            var bits: array<u32, 8>;
            for (var w = 0u; w < 8u; w = w + 1u) {
                let low = (word_at(at + 32u + 32u * half + 4u * w) >> (2u * pair)) & 0x03030303u;
                let third = (word_at(at + 4u * w) >> (4u * half + pair)) & 0x01010101u;
                bits[w] = low | (third << 2u);
            }
            let scales = vec2<i32>(q3_scale(at + 96u, g), q3_scale(at + 96u, g + 1u));
            let d = f16_at(at + 108u);
            for (var t = 0u; t < TOKENS; t = t + 1u) {
                if (has(first, t)) {
                    let xb = xk_block(first + t, blocks, b);
                    // sum (q - 4) x = sum q x - 4 sum x, per group of 16.
                    let one = dot16(bits, 0u, xb + 8u * lane) - 4 * q8k_sum(xb, g);
                    let two = dot16(bits, 4u, xb + 8u * lane + 4u) - 4 * q8k_sum(xb, g + 1u);
                    let acc = scales.x * one + scales.y * two;
                    sums[t] = sums[t] + f32(acc) * (d * q8k_scale(xb));
                }
            }
        }
    }
    finish_tile(row, first, thread, sums);
}

// x's 256-value blocks to 8 bits as llama.cpp's quantize_row_q8_K_ref
// does: the value of largest magnitude (the first, on ties) maps to -127,
// the others round half to even. One workgroup a block, 4 values a
// thread; `shape.rows` is the number of blocks.
var<workgroup> largest: array<vec2<f32>, 64>;
var<workgroup> quarter_sums: array<i32, 64>;

@compute @workgroup_size(64)
fn quantize_q8k(@builtin(workgroup_id) group: vec3<u32>,
                @builtin(num_workgroups) count: vec3<u32>,
                @builtin(local_invocation_index) thread: u32) {
    let block = group.y * count.x + group.x;
    // Uniform across the workgroup, so the barriers below are too.
    if (block >= shape.rows) {
        return;
    }
    let start = block * 256u + 4u * thread;
    // (|v|, index) of the thread's largest value, then the block's.
    var best = vec2<f32>(0.0, f32(4u * thread));
    for (var j = 0u; j < 4u; j = j + 1u) {
        let magnitude = abs(x[start + j]);
        if (magnitude > best.x) {
            best = vec2<f32>(magnitude, f32(4u * thread + j));
        }
    }
    largest[thread] = best;
    workgroupBarrier();
    for (var half = 32u; half > 0u; half = half / 2u) {
        if (thread < half) {
            let other = largest[thread + half];
            let mine = largest[thread];
            if (other.x > mine.x || (other.x == mine.x && other.y < mine.y)) {
                largest[thread] = other;
            }
        }
        workgroupBarrier();
    }
    let top = largest[0];
    // A block of zeros has scale 0 and all q 0 (no branch: the barrier
    // below must be reached by every thread).
    let nonzero = top.x != 0.0;
    let iscale = select(0.0, -127.0 / x[block * 256u + u32(top.y)], nonzero);
    var word = 0u;
    var total = 0;
    for (var j = 0u; j < 4u; j = j + 1u) {
        let q = min(127, i32(round(iscale * x[start + j])));
        total = total + q;
        word = word | ((bitcast<u32>(q) & 0xffu) << (8u * j));
    }
    let out = block * Q8K_WORDS;
    y_q[out + thread] = word;
    quarter_sums[thread] = total;
    workgroupBarrier();
    if (thread < 16u) {
        let s = quarter_sums[4u * thread] + quarter_sums[4u * thread + 1u]
            + quarter_sums[4u * thread + 2u] + quarter_sums[4u * thread + 3u];
        y_q[out + Q8K_SUMS + thread] = bitcast<u32>(s);
    }
    if (thread == 0u) {
        y_q[out + Q8K_SCALE] = bitcast<u32>(select(0.0, 1.0 / iscale, nonzero));
    }
}
