// Rotary embeddings in place over q or k (`tokens x heads x head_dim`),
// one thread per rotated pair, with the angles the CPU computed for each
// token (so every scaling the CPU supports holds here too): adjacent pairs
// (2i, 2i+1) or halves (i, i + pairs); dimensions past 2 pairs stay.

struct Params {
    count: u32,
    heads: u32,
    head_dim: u32,
    pairs: u32,
    // 0: adjacent pairs, 1: halves.
    halves: u32,
    _pad5: u32,
    _pad6: u32,
    _pad7: u32,
    _rest: array<vec4<u32>, 2>,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> x: array<f32>;
@group(0) @binding(2) var<storage, read> cos_of: array<f32>;
@group(0) @binding(3) var<storage, read> sin_of: array<f32>;

@compute @workgroup_size(64)
fn rope(@builtin(workgroup_id) group: vec3<u32>,
        @builtin(num_workgroups) count: vec3<u32>,
        @builtin(local_invocation_index) thread: u32) {
    let i = (group.y * count.x + group.x) * 64u + thread;
    if (i >= p.count) {
        return;
    }
    let pair = i % p.pairs;
    let token_head = i / p.pairs;
    let token = token_head / p.heads;
    let base = token_head * p.head_dim;
    var first = base + 2u * pair;
    var second = first + 1u;
    if (p.halves == 1u) {
        first = base + pair;
        second = first + p.pairs;
    }
    let c = cos_of[token * p.pairs + pair];
    let s = sin_of[token * p.pairs + pair];
    let a = x[first];
    let b = x[second];
    x[first] = a * c - b * s;
    x[second] = a * s + b * c;
}
