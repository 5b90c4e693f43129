// Each row of logits' best token, one workgroup per row, so that greedy
// sampling reads back three words a row instead of the vocabulary: the
// token (the lowest id among equal maxima), its logit and the softmax's
// mass relative to it (sum of exp(l - best)), the CPU's `BestToken`. A
// family with a final soft cap has it applied here first.

struct Params {
    rows: u32,
    vocab: u32,
    // 0: no soft cap.
    softcap: f32,
    _pad: u32,
    _rest: array<vec4<u32>, 3>,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> logits: array<f32>;
@group(0) @binding(2) var<storage, read_write> best: array<f32>;

const THREADS: u32 = 64u;
var<workgroup> top_logit: array<f32, 64>;
var<workgroup> top_at: array<u32, 64>;
var<workgroup> partial: array<f32, 64>;

fn logit_at(i: u32) -> f32 {
    let l = logits[i];
    if (p.softcap > 0.0) {
        return p.softcap * tanh(l / p.softcap);
    }
    return l;
}

@compute @workgroup_size(64)
fn best_of_rows(@builtin(workgroup_id) group: vec3<u32>,
                @builtin(num_workgroups) count: vec3<u32>,
                @builtin(local_invocation_index) thread: u32) {
    let row = min(group.y * count.x + group.x, p.rows - 1u);
    let start = row * p.vocab;
    var most = -3.4e38;
    var at = 0xffffffffu;
    for (var i = thread; i < p.vocab; i = i + THREADS) {
        let l = logit_at(start + i);
        // `>` is false for NaN; a thread sees its ids in order.
        if (l > most) {
            most = l;
            at = i;
        }
    }
    top_logit[thread] = most;
    top_at[thread] = at;
    workgroupBarrier();
    for (var half = THREADS / 2u; half > 0u; half = half / 2u) {
        if (thread < half) {
            let other = thread + half;
            let better = top_logit[other] > top_logit[thread]
                || (top_logit[other] == top_logit[thread] && top_at[other] < top_at[thread]);
            if (better) {
                top_logit[thread] = top_logit[other];
                top_at[thread] = top_at[other];
            }
        }
        workgroupBarrier();
    }
    let winner = top_logit[0];
    var mass = 0.0;
    for (var i = thread; i < p.vocab; i = i + THREADS) {
        mass = mass + exp(min(logit_at(start + i) - winner, 0.0));
    }
    partial[thread] = mass;
    workgroupBarrier();
    for (var half = THREADS / 2u; half > 0u; half = half / 2u) {
        if (thread < half) {
            partial[thread] = partial[thread] + partial[thread + half];
        }
        workgroupBarrier();
    }
    if (thread == 0u) {
        best[3u * row] = bitcast<f32>(select(top_at[0], 0u, top_at[0] == 0xffffffffu));
        best[3u * row + 1u] = winner;
        best[3u * row + 2u] = partial[0];
    }
}
