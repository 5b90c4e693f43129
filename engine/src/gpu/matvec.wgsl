// The decode step's matrix-vector product y = W x, one workgroup per row
// of W: its threads take the row's blocks in turn and the workgroup adds
// their partial sums. W is f32, or one of GGUF's formats of 32-value
// blocks, read as GGUF stores them (blocks of 34, 18 or 20 bytes, so bytes
// are read out of u32 words):
// - Q8_0: an f16 scale d, then 32 int8 q: d q;
// - Q4_0: d, then 16 bytes, value j in byte j's low nibble and value
//   j + 16 in its high one: d (q - 8);
// - Q4_1: d, an f16 minimum m, then Q4_0's nibbles: d q + m.

struct Shape {
    rows: u32,
    cols: u32,
    // Workgroups along x per row of the grid (rows beyond 65535 use y).
    grid_x: u32,
    _pad: u32,
}

@group(0) @binding(0) var<storage, read> weights: array<u32>;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read_write> y: array<f32>;
@group(0) @binding(3) var<uniform> shape: Shape;

const THREADS: u32 = 64u;
var<workgroup> partial: array<f32, 64>;

fn byte_at(offset: u32) -> u32 {
    return (weights[offset >> 2u] >> ((offset & 3u) * 8u)) & 0xffu;
}

fn int8_at(offset: u32) -> f32 {
    return f32(bitcast<i32>(byte_at(offset) << 24u) >> 24u);
}

fn f16_at(offset: u32) -> f32 {
    return unpack2x16float(byte_at(offset) | (byte_at(offset + 1u) << 8u)).x;
}

// The row of W this workgroup computes (the grid wraps rows to y).
fn row_of(group: vec3<u32>) -> u32 {
    return group.y * shape.grid_x + group.x;
}

// Adds the threads' partial sums and writes the row's value.
fn finish(row: u32, thread: u32, partial_sum: f32) {
    let total = reduce(thread, partial_sum);
    if (thread == 0u && row < shape.rows) {
        y[row] = total;
    }
}

// The workgroup's sum of `value`, in thread 0.
fn reduce(thread: u32, value: f32) -> f32 {
    partial[thread] = value;
    workgroupBarrier();
    for (var half = THREADS / 2u; half > 0u; half = half / 2u) {
        if (thread < half) {
            partial[thread] = partial[thread] + partial[thread + half];
        }
        workgroupBarrier();
    }
    return partial[0];
}

@compute @workgroup_size(64)
fn matvec_f32(@builtin(workgroup_id) group: vec3<u32>,
              @builtin(local_invocation_index) thread: u32) {
    let row = row_of(group);
    var sum = 0.0;
    if (row < shape.rows) {
        let start = row * shape.cols;
        for (var c = thread; c < shape.cols; c = c + THREADS) {
            sum = sum + bitcast<f32>(weights[start + c]) * x[c];
        }
    }
    finish(row, thread, sum);
}

@compute @workgroup_size(64)
fn matvec_q8_0(@builtin(workgroup_id) group: vec3<u32>,
               @builtin(local_invocation_index) thread: u32) {
    let row = row_of(group);
    let blocks = shape.cols / 32u;
    var sum = 0.0;
    if (row < shape.rows) {
        for (var b = thread; b < blocks; b = b + THREADS) {
            let at = (row * blocks + b) * 34u;
            var block = 0.0;
            for (var i = 0u; i < 32u; i = i + 1u) {
                block = block + int8_at(at + 2u + i) * x[b * 32u + i];
            }
            sum = sum + f16_at(at) * block;
        }
    }
    finish(row, thread, sum);
}

@compute @workgroup_size(64)
fn matvec_q4_0(@builtin(workgroup_id) group: vec3<u32>,
               @builtin(local_invocation_index) thread: u32) {
    let row = row_of(group);
    let blocks = shape.cols / 32u;
    var sum = 0.0;
    if (row < shape.rows) {
        for (var b = thread; b < blocks; b = b + THREADS) {
            let at = (row * blocks + b) * 18u;
            let base = b * 32u;
            var block = 0.0;
            for (var j = 0u; j < 16u; j = j + 1u) {
                let q = byte_at(at + 2u + j);
                block = block + (f32(q & 15u) - 8.0) * x[base + j]
                    + (f32(q >> 4u) - 8.0) * x[base + j + 16u];
            }
            sum = sum + f16_at(at) * block;
        }
    }
    finish(row, thread, sum);
}

@compute @workgroup_size(64)
fn matvec_q4_1(@builtin(workgroup_id) group: vec3<u32>,
               @builtin(local_invocation_index) thread: u32) {
    let row = row_of(group);
    let blocks = shape.cols / 32u;
    var sum = 0.0;
    if (row < shape.rows) {
        for (var b = thread; b < blocks; b = b + THREADS) {
            let at = (row * blocks + b) * 20u;
            let base = b * 32u;
            var block = 0.0;
            var plain = 0.0;
            for (var j = 0u; j < 16u; j = j + 1u) {
                let q = byte_at(at + 4u + j);
                let low = x[base + j];
                let high = x[base + j + 16u];
                block = block + f32(q & 15u) * low + f32(q >> 4u) * high;
                plain = plain + low + high;
            }
            sum = sum + f16_at(at) * block + f16_at(at + 2u) * plain;
        }
    }
    finish(row, thread, sum);
}
