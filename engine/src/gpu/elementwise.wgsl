// Value-by-value kernels over `count` values of `a`, reading `b`, one
// thread per value (the grid wraps to y past 65535 workgroups).

struct Params {
    count: u32,
    // add_bias: the bias's length (a's rows are this wide).
    width: u32,
    _pad: vec2<u32>,
    _rest: array<vec4<u32>, 3>,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> a: array<f32>;
@group(0) @binding(2) var<storage, read> b: array<f32>;

fn index_of(group: vec3<u32>, count: vec3<u32>, thread: u32) -> u32 {
    return (group.y * count.x + group.x) * 64u + thread;
}

// a += b (the residual adds).
@compute @workgroup_size(64)
fn add(@builtin(workgroup_id) group: vec3<u32>,
       @builtin(num_workgroups) count: vec3<u32>,
       @builtin(local_invocation_index) thread: u32) {
    let i = index_of(group, count, thread);
    if (i < p.count) {
        a[i] = a[i] + b[i];
    }
}

// a += b, b one row of `width` added to every row of a.
@compute @workgroup_size(64)
fn add_bias(@builtin(workgroup_id) group: vec3<u32>,
            @builtin(num_workgroups) count: vec3<u32>,
            @builtin(local_invocation_index) thread: u32) {
    let i = index_of(group, count, thread);
    if (i < p.count) {
        a[i] = a[i] + b[i % p.width];
    }
}

// a = b (a family without a pre-norm).
@compute @workgroup_size(64)
fn copy(@builtin(workgroup_id) group: vec3<u32>,
        @builtin(num_workgroups) count: vec3<u32>,
        @builtin(local_invocation_index) thread: u32) {
    let i = index_of(group, count, thread);
    if (i < p.count) {
        a[i] = b[i];
    }
}

// a = silu(a) b (SwiGLU: a the gate, b the up projection).
@compute @workgroup_size(64)
fn silu_mul(@builtin(workgroup_id) group: vec3<u32>,
            @builtin(num_workgroups) count: vec3<u32>,
            @builtin(local_invocation_index) thread: u32) {
    let i = index_of(group, count, thread);
    if (i < p.count) {
        let g = a[i];
        a[i] = g / (1.0 + exp_poly(-g)) * b[i];
    }
}

// a = gelu_tanh(a) b (GeGLU).
@compute @workgroup_size(64)
fn gelu_mul(@builtin(workgroup_id) group: vec3<u32>,
            @builtin(num_workgroups) count: vec3<u32>,
            @builtin(local_invocation_index) thread: u32) {
    let i = index_of(group, count, thread);
    if (i < p.count) {
        let x = a[i];
        let inner = 0.7978846 * (x + 0.044715 * x * x * x);
        a[i] = 0.5 * x * (1.0 + tanh(inner)) * b[i];
    }
}

// a = each row of 2 width values of b's first half (gated attention's
// query heads, each followed by its gate).
@compute @workgroup_size(64)
fn first_halves(@builtin(workgroup_id) group: vec3<u32>,
                @builtin(num_workgroups) count: vec3<u32>,
                @builtin(local_invocation_index) thread: u32) {
    let i = index_of(group, count, thread);
    if (i < p.count) {
        a[i] = b[(i / p.width) * 2u * p.width + i % p.width];
    }
}

// a = each row of 2 width values of b's second half (the gates).
@compute @workgroup_size(64)
fn second_halves(@builtin(workgroup_id) group: vec3<u32>,
                 @builtin(num_workgroups) count: vec3<u32>,
                 @builtin(local_invocation_index) thread: u32) {
    let i = index_of(group, count, thread);
    if (i < p.count) {
        a[i] = b[(i / p.width) * 2u * p.width + p.width + i % p.width];
    }
}

// a = a sigmoid(b) (gated attention's output gate).
@compute @workgroup_size(64)
fn sigmoid_mul(@builtin(workgroup_id) group: vec3<u32>,
               @builtin(num_workgroups) count: vec3<u32>,
               @builtin(local_invocation_index) thread: u32) {
    let i = index_of(group, count, thread);
    if (i < p.count) {
        a[i] = a[i] * (1.0 / (1.0 + exp(-b[i])));
    }
}
