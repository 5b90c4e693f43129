// Gated DeltaNet, the linear attention of the hybrid Qwens, as the CPU's
// `model::deltanet` computes it. A sequence's state (the convolution's
// last inputs, then each value head's S, key_dim x value_dim) lives in a
// slot of `states`; a span that starts at position 0 starts from zeros.
//
// Each span is four words of `spans`: its first token in the step, its
// tokens, its slot, and 1 where it starts at position 0.

struct Params {
    // conv: (span, channel) threads; l2_heads: heads; gates: (token,
    // head) pairs; recur: value heads.
    count: u32,
    a: u32,
    b: u32,
    c: u32,
    d: u32,
    e: u32,
    f: u32,
    g: u32,
    _rest: array<vec4<u32>, 2>,
}

@group(0) @binding(0) var<uniform> p: Params;

fn index_of(group: vec3<u32>, count: vec3<u32>, thread: u32) -> u32 {
    return (group.y * count.x + group.x) * 64u + thread;
}

fn sigmoid(x: f32) -> f32 {
    return 1.0 / (1.0 + exp(-x));
}

fn silu(x: f32) -> f32 {
    return x * sigmoid(x);
}

// ---- conv: one section (q, k or v) of the causal depthwise convolution
// and silu, one thread per (span, channel), over the span's tokens in
// order. a: the section's channels (its row width), b: its first channel
// of all, c: all channels, d: taps per channel, e: floats per slot, f:
// this layer's offset in a slot, g: spans.

@group(0) @binding(1) var<storage, read_write> section: array<f32>;
@group(0) @binding(2) var<storage, read> taps: array<f32>;
@group(0) @binding(3) var<storage, read_write> states: array<f32>;
@group(0) @binding(4) var<storage, read> spans: array<u32>;

const MOST_TAPS: u32 = 8u;

@compute @workgroup_size(64)
fn conv(@builtin(workgroup_id) group: vec3<u32>,
        @builtin(num_workgroups) count: vec3<u32>,
        @builtin(local_invocation_index) thread: u32) {
    let i = index_of(group, count, thread);
    let width = p.a;
    if (i >= p.g * width) {
        return;
    }
    let span = i / width;
    let column = i % width;
    let channel = p.b + column;
    let kernel = p.d;
    let history = kernel - 1u;
    let first = spans[4u * span];
    let tokens = spans[4u * span + 1u];
    let base = spans[4u * span + 2u] * p.e + p.f;
    var past: array<f32, MOST_TAPS>;
    for (var j = 0u; j < history; j = j + 1u) {
        past[j] = select(states[base + j * p.c + channel], 0.0, spans[4u * span + 3u] != 0u);
    }
    for (var t = first; t < first + tokens; t = t + 1u) {
        let value = section[t * width + column];
        var sum = 0.0;
        for (var j = 0u; j < history; j = j + 1u) {
            sum = sum + taps[channel * kernel + j] * past[j];
        }
        sum = sum + taps[channel * kernel + history] * value;
        for (var j = 1u; j < history; j = j + 1u) {
            past[j - 1u] = past[j];
        }
        if (history > 0u) {
            past[history - 1u] = value;
        }
        section[t * width + column] = silu(sum);
    }
    for (var j = 0u; j < history; j = j + 1u) {
        states[base + j * p.c + channel] = past[j];
    }
}

// ---- l2_heads: each of `count` heads of `a` values to unit length (eps
// b's bits), then scaled by c's bits.

@group(0) @binding(1) var<storage, read_write> heads: array<f32>;

@compute @workgroup_size(64)
fn l2_heads(@builtin(workgroup_id) group: vec3<u32>,
            @builtin(num_workgroups) count: vec3<u32>,
            @builtin(local_invocation_index) thread: u32) {
    let head = index_of(group, count, thread);
    if (head >= p.count) {
        return;
    }
    let start = head * p.a;
    var sum = 0.0;
    for (var j = 0u; j < p.a; j = j + 1u) {
        sum = sum + heads[start + j] * heads[start + j];
    }
    let scale = 1.0 / sqrt(sum + bitcast<f32>(p.b));
    let after = bitcast<f32>(p.c);
    for (var j = 0u; j < p.a; j = j + 1u) {
        heads[start + j] = heads[start + j] * scale * after;
    }
}

// ---- gates: per (token, value head), beta = sigmoid(b) and the decay
// exp(A softplus(a + dt)), two words. a: value heads, b: the width of a
// row of b's (and a's) products. `head_gates`: per value head, where its
// b and a sit in those rows, A and dt (four words).

@group(0) @binding(1) var<storage, read> beta_rows: array<f32>;
@group(0) @binding(2) var<storage, read> alpha_rows: array<f32>;
@group(0) @binding(3) var<storage, read> head_gates: array<u32>;
@group(0) @binding(4) var<storage, read_write> gate_values: array<f32>;

fn softplus(x: f32) -> f32 {
    if (x > 20.0) {
        return x;
    }
    return log(1.0 + exp(x));
}

@compute @workgroup_size(64)
fn gates(@builtin(workgroup_id) group: vec3<u32>,
         @builtin(num_workgroups) count: vec3<u32>,
         @builtin(local_invocation_index) thread: u32) {
    let i = index_of(group, count, thread);
    if (i >= p.count) {
        return;
    }
    let token = i / p.a;
    let head = i % p.a;
    let b = beta_rows[token * p.b + head_gates[4u * head]];
    let a = alpha_rows[token * p.b + head_gates[4u * head + 1u]];
    let decay = bitcast<f32>(head_gates[4u * head + 2u]);
    let dt = bitcast<f32>(head_gates[4u * head + 3u]);
    gate_values[2u * i] = sigmoid(b);
    gate_values[2u * i + 1u] = exp(decay * softplus(a + dt));
}

// ---- recur: the delta rule, a workgroup per (span, value head), a
// thread per column of S (strided by 64), over the span's tokens in
// order. a: value heads, b: key_dim, c: value_dim, d: key heads, e:
// floats per slot, f: where this layer's S start in a slot, g: value
// heads per key head when grouped, 0 when tiled (head j reads key head
// j % key heads).

@group(0) @binding(1) var<storage, read> rq: array<f32>;
@group(0) @binding(2) var<storage, read> rk: array<f32>;
@group(0) @binding(3) var<storage, read> rv: array<f32>;
@group(0) @binding(4) var<storage, read> step_gates: array<f32>;
@group(0) @binding(5) var<storage, read_write> rstates: array<f32>;
@group(0) @binding(6) var<storage, read> rspans: array<u32>;
@group(0) @binding(7) var<storage, read_write> rout: array<f32>;

@compute @workgroup_size(64)
fn recur(@builtin(workgroup_id) group: vec3<u32>,
         @builtin(local_invocation_index) thread: u32) {
    let head = group.x;
    let span = group.y;
    let dk = p.b;
    let dv = p.c;
    var key = head % p.d;
    if (p.g != 0u) {
        key = head / p.g;
    }
    let first = rspans[4u * span];
    let tokens = rspans[4u * span + 1u];
    let s = rspans[4u * span + 2u] * p.e + p.f + head * dk * dv;
    let fresh = rspans[4u * span + 3u] != 0u;
    let qk = p.d * dk;
    let vw = p.a * dv;
    for (var c = thread; c < dv; c = c + 64u) {
        if (fresh) {
            for (var i = 0u; i < dk; i = i + 1u) {
                rstates[s + i * dv + c] = 0.0;
            }
        }
        for (var t = first; t < first + tokens; t = t + 1u) {
            let gate = 2u * (t * p.a + head);
            let beta = step_gates[gate];
            let decay = step_gates[gate + 1u];
            let k0 = t * qk + key * dk;
            var delta = rv[t * vw + head * dv + c];
            for (var i = 0u; i < dk; i = i + 1u) {
                let decayed = rstates[s + i * dv + c] * decay;
                rstates[s + i * dv + c] = decayed;
                delta = delta - decayed * rk[k0 + i];
            }
            delta = delta * beta;
            var out = 0.0;
            for (var i = 0u; i < dk; i = i + 1u) {
                let updated = rstates[s + i * dv + c] + rk[k0 + i] * delta;
                rstates[s + i * dv + c] = updated;
                out = out + rq[k0 + i] * updated;
            }
            rout[t * vw + head * dv + c] = out;
        }
    }
}
