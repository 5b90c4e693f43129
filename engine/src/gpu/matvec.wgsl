// The matrix products y = W x of the forward pass. A workgroup of 64
// threads computes 8 rows of W for one token, 8 threads a row: each takes
// every 8th block of the row, and the row's threads add their partial
// sums. Token t reads its row of x and writes y[t] (rows values).
//
// W is f32 (with f32 x), or one of GGUF's formats of 32-value blocks, read
// as GGUF stores them (blocks of 34, 18 or 20 bytes, so bytes are read out
// of u32 words):
// - Q8_0: an f16 scale d, then 32 int8 q: d q;
// - Q4_0: d, then 16 bytes, value j in byte j's low nibble and value
//   j + 16 in its high one: d (q - 8);
// - Q4_1: d, an f16 minimum m, then Q4_0's nibbles: d q + m.
// Their x is rounded to 8-bit blocks first (`quantize_q8`), as llama.cpp
// and the CPU engine do: per block 8 words of i8, a scale dx and dx sum(q),
// both through f16. A block's dot product is then an exact integer, and a
// row is sum(int * d * dx) (+ m * dx sum(q) for Q4_1), the CPU's
// arithmetic in another order across blocks.

struct Params {
    rows: u32,
    cols: u32,
    _pad: vec2<u32>,
    _rest: array<vec4<u32>, 3>,
}

@group(0) @binding(0) var<uniform> shape: Params;
@group(0) @binding(1) var<storage, read> weights: array<u32>;
@group(0) @binding(2) var<storage, read> x: array<f32>;
@group(0) @binding(3) var<storage, read_write> y: array<f32>;
// The 8-bit blocks of x (10 words each), for the block formats.
@group(0) @binding(4) var<storage, read> xq: array<u32>;
// Where `quantize_q8` writes them.
@group(0) @binding(5) var<storage, read_write> y_q: array<u32>;

const THREADS: u32 = 64u;
const ROWS: u32 = 8u;
const LANES: u32 = 8u;
const Q8_WORDS: u32 = 10u;
var<workgroup> partial: array<f32, 64>;

fn byte_at(offset: u32) -> u32 {
    return (weights[offset >> 2u] >> ((offset & 3u) * 8u)) & 0xffu;
}

fn f16_at(offset: u32) -> f32 {
    return unpack2x16float(byte_at(offset) | (byte_at(offset + 1u) << 8u)).x;
}

fn xq_scale(block: u32) -> f32 {
    return bitcast<f32>(xq[block + 8u]);
}

fn xq_sum(block: u32) -> f32 {
    return bitcast<f32>(xq[block + 9u]);
}

// The row of W this thread works on (the grid wraps to y), and its lane.
fn row_of(group: vec3<u32>, count: vec3<u32>, thread: u32) -> u32 {
    return (group.y * count.x + group.x) * ROWS + thread / LANES;
}

// Adds each row's lanes and writes the rows' values.
fn finish(row: u32, token: u32, thread: u32, partial_sum: f32) {
    partial[thread] = partial_sum;
    workgroupBarrier();
    let lane = thread % LANES;
    for (var half = LANES / 2u; half > 0u; half = half / 2u) {
        if (lane < half) {
            partial[thread] = partial[thread] + partial[thread + half];
        }
        workgroupBarrier();
    }
    if (lane == 0u && row < shape.rows) {
        y[token * shape.rows + row] = partial[thread];
    }
}

@compute @workgroup_size(64)
fn matvec_f32(@builtin(workgroup_id) group: vec3<u32>,
              @builtin(num_workgroups) count: vec3<u32>,
              @builtin(local_invocation_index) thread: u32) {
    let row = row_of(group, count, thread);
    let xs = group.z * shape.cols;
    var sum = 0.0;
    if (row < shape.rows) {
        let start = row * shape.cols;
        for (var c = thread % LANES; c < shape.cols; c = c + LANES) {
            sum = sum + bitcast<f32>(weights[start + c]) * x[xs + c];
        }
    }
    finish(row, group.z, thread, sum);
}

// The word of W's bytes starting at byte `offset` (any alignment).
fn word_at(offset: u32) -> u32 {
    let first = offset >> 2u;
    let shift = (offset & 3u) * 8u;
    if (shift == 0u) {
        return weights[first];
    }
    return (weights[first] >> shift) | (weights[first + 1u] << (32u - shift));
}

const LOW_NIBBLES: u32 = 0x0f0f0f0fu;

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
            let at = (row * blocks + b) * 34u;
            let xb = (group.z * blocks + b) * Q8_WORDS;
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
            let at = (row * blocks + b) * 18u;
            let xb = (group.z * blocks + b) * Q8_WORDS;
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
            let at = (row * blocks + b) * 20u;
            let xb = (group.z * blocks + b) * Q8_WORDS;
            // Blocks of 20 bytes start on a word: d and m are one word.
            let scales = unpack2x16float(weights[at >> 2u]);
            sum = sum + f32(nibble_dot(at + 4u, xb)) * (scales.x * xq_scale(xb));
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
