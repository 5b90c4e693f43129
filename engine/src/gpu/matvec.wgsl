// The decode step's matrix-vector product y = W x, one workgroup per row
// of W: its threads take the row's blocks in turn and the workgroup adds
// their partial sums. W is f32, or Q8_0 (GGUF's blocks of 32 int8 values
// with an f16 scale, 34 bytes each, so bytes are read out of u32 words).

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
    let row = group.y * shape.grid_x + group.x;
    var sum = 0.0;
    if (row < shape.rows) {
        let start = row * shape.cols;
        for (var c = thread; c < shape.cols; c = c + THREADS) {
            sum = sum + bitcast<f32>(weights[start + c]) * x[c];
        }
    }
    let total = reduce(thread, sum);
    if (thread == 0u && row < shape.rows) {
        y[row] = total;
    }
}

@compute @workgroup_size(64)
fn matvec_q8_0(@builtin(workgroup_id) group: vec3<u32>,
               @builtin(local_invocation_index) thread: u32) {
    let row = group.y * shape.grid_x + group.x;
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
    let total = reduce(thread, sum);
    if (thread == 0u && row < shape.rows) {
        y[row] = total;
    }
}
