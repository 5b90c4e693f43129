// RMS norm, one workgroup per row of `width` values: out = x / rms(x) * w.
// `mode` 0 reads rows of `input`; 1 the rows `picked` names (the tokens
// that want logits); 2 norms `out` itself (q and k norms, post-norms).
// Bindings a mode does not read are bound to any buffer.

struct Params {
    rows: u32,
    width: u32,
    eps: f32,
    mode: u32,
    _rest: array<vec4<u32>, 3>,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> input: array<f32>;
@group(0) @binding(2) var<storage, read> weight: array<f32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;
@group(0) @binding(4) var<storage, read> picked: array<u32>;

const THREADS: u32 = 64u;
var<workgroup> partial: array<f32, 64>;

// The workgroup's sum of `value`, in every thread.
fn reduce(thread: u32, value: f32) -> f32 {
    partial[thread] = value;
    workgroupBarrier();
    for (var half = THREADS / 2u; half > 0u; half = half / 2u) {
        if (thread < half) {
            partial[thread] = partial[thread] + partial[thread + half];
        }
        workgroupBarrier();
    }
    let total = partial[0];
    workgroupBarrier();
    return total;
}

fn row_of(group: vec3<u32>, count: vec3<u32>) -> u32 {
    return group.y * count.x + group.x;
}

fn scale_of(thread: u32, squares: f32) -> f32 {
    let mean = reduce(thread, squares) / f32(p.width);
    return 1.0 / sqrt(mean + p.eps);
}

// Where row `row`'s values are read: `input`'s row, the row `picked`
// names, or `out`'s own row.
fn read_at(row_start: u32, i: u32) -> f32 {
    if (p.mode == 2u) {
        return out[row_start + i];
    }
    return input[row_start + i];
}

@compute @workgroup_size(64)
fn rms_norm(@builtin(workgroup_id) group: vec3<u32>,
            @builtin(num_workgroups) count: vec3<u32>,
            @builtin(local_invocation_index) thread: u32) {
    let row = min(row_of(group, count), p.rows - 1u);
    var source = row * p.width;
    if (p.mode == 1u) {
        source = picked[row] * p.width;
    }
    let target_start = row * p.width;
    var squares = 0.0;
    for (var i = thread; i < p.width; i = i + THREADS) {
        let v = read_at(source, i);
        squares = squares + v * v;
    }
    let scale = scale_of(thread, squares);
    for (var i = thread; i < p.width; i = i + THREADS) {
        out[target_start + i] = (read_at(source, i) * scale) * weight[i];
    }
}
