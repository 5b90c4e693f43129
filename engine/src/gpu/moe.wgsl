// A mixture of experts' routing and weighted sum (the CPU's `model::moe`).
//
// `route`: one thread per token. Its router logits go through the CPU's
// softmax (its exp, its fold of eight values; the sum in f32 where the CPU
// keeps f64), then the `per_token` most likely experts are taken, best
// first, ties to the lower index, with their probabilities as weights
// (renormalised to sum to one where the family does). Each (token, slot)
// gets two words: the expert and its weight's bits; the products of
// `matvec_common.wgsl` read them.
//
// `sum_experts`: one thread per value of the output: a token's experts'
// rows weighted and added in its own slot order, as on the CPU.

struct Params {
    tokens: u32,
    // route: experts; sum_experts: the output's width.
    experts: u32,
    per_token: u32,
    normalize: u32,
    _rest: array<vec4<u32>, 3>,
}

@group(0) @binding(0) var<uniform> p: Params;
// route: the router's logits, softmaxed in place; sum_experts: each
// (token, slot)'s expert output rows.
@group(0) @binding(1) var<storage, read_write> rows: array<f32>;
@group(0) @binding(2) var<storage, read_write> routes: array<u32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;

fn index_of(group: vec3<u32>, count: vec3<u32>, thread: u32) -> u32 {
    return (group.y * count.x + group.x) * 64u + thread;
}

// Softmax of the `n` logits from `start`, in place.
fn softmax(start: u32, n: u32) {
    var top = rows[start];
    for (var i = 1u; i < n; i = i + 1u) {
        top = max(top, rows[start + i]);
    }
    var sum = 0.0;
    for (var block = 0u; block < n; block = block + 8u) {
        var lanes = array<f32, 8>(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0);
        for (var j = 0u; j < 8u && block + j < n; j = j + 1u) {
            let e = exp_poly(rows[start + block + j] - top);
            rows[start + block + j] = e;
            lanes[j] = e;
        }
        sum = sum + (((lanes[0] + lanes[4]) + (lanes[2] + lanes[6]))
            + ((lanes[1] + lanes[5]) + (lanes[3] + lanes[7])));
    }
    let inverse = 1.0 / sum;
    for (var i = 0u; i < n; i = i + 1u) {
        rows[start + i] = rows[start + i] * inverse;
    }
}

@compute @workgroup_size(64)
fn route(@builtin(workgroup_id) group: vec3<u32>,
         @builtin(num_workgroups) count: vec3<u32>,
         @builtin(local_invocation_index) thread: u32) {
    let token = index_of(group, count, thread);
    if (token >= p.tokens) {
        return;
    }
    let start = token * p.experts;
    softmax(start, p.experts);
    let first = token * p.per_token;
    var total = 0.0;
    for (var slot = 0u; slot < p.per_token; slot = slot + 1u) {
        var best = 0u;
        var best_p = 0.0;
        var found = false;
        for (var e = 0u; e < p.experts; e = e + 1u) {
            var taken = false;
            for (var s = 0u; s < slot; s = s + 1u) {
                taken = taken || routes[2u * (first + s)] == e;
            }
            let prob = rows[start + e];
            if (!taken && (!found || prob > best_p)) {
                best = e;
                best_p = prob;
                found = true;
            }
        }
        routes[2u * (first + slot)] = best;
        routes[2u * (first + slot) + 1u] = bitcast<u32>(best_p);
        total = total + best_p;
    }
    if (p.normalize != 0u && total > 0.0) {
        for (var slot = 0u; slot < p.per_token; slot = slot + 1u) {
            let at = 2u * (first + slot) + 1u;
            routes[at] = bitcast<u32>(bitcast<f32>(routes[at]) / total);
        }
    }
}

@compute @workgroup_size(64)
fn sum_experts(@builtin(workgroup_id) group: vec3<u32>,
               @builtin(num_workgroups) count: vec3<u32>,
               @builtin(local_invocation_index) thread: u32) {
    let i = index_of(group, count, thread);
    let width = p.experts;
    if (i >= p.tokens * width) {
        return;
    }
    let token = i / width;
    let column = i % width;
    let first = token * p.per_token;
    var acc = 0.0;
    for (var slot = 0u; slot < p.per_token; slot = slot + 1u) {
        let weight = bitcast<f32>(routes[2u * (first + slot) + 1u]);
        acc = acc + rows[(first + slot) * width + column] * weight;
    }
    out[i] = acc;
}

// add_shared: out[t] += sigmoid(x[t] . gate) rows[t] (a shared expert's
// output scaled by its gate), a workgroup per token. experts: the width.
@group(0) @binding(4) var<storage, read> shared_x: array<f32>;
@group(0) @binding(5) var<storage, read> shared_gate: array<f32>;
var<workgroup> partial: array<f32, 64>;

@compute @workgroup_size(64)
fn add_shared(@builtin(workgroup_id) group: vec3<u32>,
              @builtin(num_workgroups) count: vec3<u32>,
              @builtin(local_invocation_index) thread: u32) {
    let token = group.y * count.x + group.x;
    if (token >= p.tokens) {
        return;
    }
    let width = p.experts;
    var sum = 0.0;
    for (var c = thread; c < width; c = c + 64u) {
        sum = sum + shared_x[token * width + c] * shared_gate[c];
    }
    partial[thread] = sum;
    workgroupBarrier();
    for (var half = 32u; half > 0u; half = half / 2u) {
        if (thread < half) {
            partial[thread] = partial[thread] + partial[thread + half];
        }
        workgroupBarrier();
    }
    let scale = 1.0 / (1.0 + exp(-partial[0]));
    for (var c = thread; c < width; c = c + 64u) {
        out[token * width + c] = out[token * width + c] + scale * rows[token * width + c];
    }
}
