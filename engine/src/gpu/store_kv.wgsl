// Writes a step's keys and values into the paged cache, in f16 (two to a
// u32 word): token t's row goes to slot slots[t] (its block times 16 plus
// its place in the block), one thread per word.

struct Params {
    count: u32,
    // Words per row: kv_dim / 2.
    words: u32,
    _pad: vec2<u32>,
    _rest: array<vec4<u32>, 3>,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> k: array<f32>;
@group(0) @binding(2) var<storage, read> v: array<f32>;
@group(0) @binding(3) var<storage, read_write> keys: array<u32>;
@group(0) @binding(4) var<storage, read_write> values: array<u32>;
@group(0) @binding(5) var<storage, read> slots: array<u32>;

@compute @workgroup_size(64)
fn store_kv(@builtin(workgroup_id) group: vec3<u32>,
            @builtin(num_workgroups) count: vec3<u32>,
            @builtin(local_invocation_index) thread: u32) {
    let i = (group.y * count.x + group.x) * 64u + thread;
    if (i >= p.count) {
        return;
    }
    let token = i / p.words;
    let word = i % p.words;
    let at = slots[token] * p.words + word;
    let start = 2u * i;
    keys[at] = pack2x16float(vec2<f32>(k[start], k[start + 1u]));
    values[at] = pack2x16float(vec2<f32>(v[start], v[start + 1u]));
}
