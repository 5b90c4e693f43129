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

// Each row's TOP best (token, logit) pairs, best first and the lower id
// first among equal logits, NaN never: the CPU's `collect_best`, so that
// top-k sampling reads back 2 * TOP words a row (after best_of_rows' three
// words a row, at word 3 * rows). One workgroup a row: a radix select
// finds the TOP-th largest logit a byte at a time (four histogram passes
// over the row), the logits above it and the lowest ids equal to it are
// gathered, and the TOP are ranked. A row with fewer non-NaN logits pads
// with id 0xffffffff.

const TOP: u32 = 64u;
const TOP_THREADS: u32 = 256u;
var<workgroup> histogram: array<atomic<u32>, 256>;
// The threshold's bytes so far, and how many logits equal to it to take.
var<workgroup> threshold: u32;
var<workgroup> ties_wanted: u32;
var<workgroup> taken: atomic<u32>;
var<workgroup> ties_before: array<u32, 256>;
var<workgroup> kept_id: array<u32, 64>;
var<workgroup> kept_key: array<u32, 64>;

// Logits as unsigned keys in the same order (both zeros alike); NaN is 0,
// below every other key (-inf is 0x007fffff). Bit tests, because a shader
// compiler may assume that floats are never NaN.
fn key_of(l: f32) -> u32 {
    let bits = bitcast<u32>(l);
    if ((bits & 0x7fffffffu) > 0x7f800000u) {
        return 0u;
    }
    if ((bits & 0x7fffffffu) == 0u) {
        return 0x80000000u;
    }
    return select(bits | 0x80000000u, ~bits, (bits & 0x80000000u) != 0u);
}

// Narrows `threshold` by one byte (`shift`: 24, 16, 8, 0) among the keys
// that share its higher bytes: the byte holding the ties_wanted-th key.
fn select_byte(start: u32, shift: u32, thread: u32) {
    atomicStore(&histogram[thread], 0u);
    workgroupBarrier();
    let prefix = threshold;
    let high = select(0xffffffffu << (shift + 8u), 0u, shift == 24u);
    for (var i = thread; i < p.vocab; i = i + TOP_THREADS) {
        let key = key_of(logit_at(start + i));
        if ((key & high) == (prefix & high)) {
            atomicAdd(&histogram[(key >> shift) & 255u], 1u);
        }
    }
    workgroupBarrier();
    if (thread == 0u) {
        var above = 0u;
        for (var b = 255i; b >= 0i; b = b - 1i) {
            let here = atomicLoad(&histogram[b]);
            if (above + here >= ties_wanted) {
                threshold = prefix | (u32(b) << shift);
                ties_wanted = ties_wanted - above;
                break;
            }
            above = above + here;
        }
    }
    workgroupBarrier();
}

@compute @workgroup_size(256)
fn top_of_rows(@builtin(workgroup_id) group: vec3<u32>,
               @builtin(num_workgroups) count: vec3<u32>,
               @builtin(local_invocation_index) thread: u32) {
    let row = min(group.y * count.x + group.x, p.rows - 1u);
    let start = row * p.vocab;
    let wanted = min(TOP, p.vocab);
    if (thread == 0u) {
        threshold = 0u;
        ties_wanted = wanted;
        atomicStore(&taken, 0u);
    }
    workgroupBarrier();
    for (var shift = 24i; shift >= 0i; shift = shift - 8i) {
        select_byte(start, u32(shift), thread);
    }
    // Keys above the threshold number wanted - ties_wanted: each takes a
    // slot. Each thread counts the ties of its own run of ids, so that
    // they are ranked by id.
    let limit = threshold;
    let run = (p.vocab + TOP_THREADS - 1u) / TOP_THREADS;
    let first = min(thread * run, p.vocab);
    let end = min(first + run, p.vocab);
    var ties = 0u;
    for (var i = first; i < end; i = i + 1u) {
        let key = key_of(logit_at(start + i));
        if (key > limit) {
            let slot = atomicAdd(&taken, 1u);
            kept_id[slot] = i;
            kept_key[slot] = key;
        } else if (key == limit && limit != 0u) {
            ties = ties + 1u;
        }
    }
    ties_before[thread] = ties;
    workgroupBarrier();
    if (thread == 0u) {
        var sum = 0u;
        for (var t = 0u; t < TOP_THREADS; t = t + 1u) {
            let here = ties_before[t];
            ties_before[t] = sum;
            sum = sum + here;
        }
    }
    workgroupBarrier();
    let above = wanted - ties_wanted;
    var rank = ties_before[thread];
    for (var i = first; i < end && rank < ties_wanted; i = i + 1u) {
        if (limit != 0u && key_of(logit_at(start + i)) == limit) {
            kept_id[above + rank] = i;
            kept_key[above + rank] = limit;
            rank = rank + 1u;
        }
    }
    workgroupBarrier();
    // NaN ties (a threshold of 0) are not taken.
    let kept = select(wanted, above, limit == 0u);
    if (thread < TOP) {
        let out = 3u * p.rows + 2u * TOP * row;
        if (thread < kept) {
            let key = kept_key[thread];
            let id = kept_id[thread];
            var place = 0u;
            for (var j = 0u; j < kept; j = j + 1u) {
                let other = kept_key[j];
                if (other > key || (other == key && kept_id[j] < id)) {
                    place = place + 1u;
                }
            }
            best[out + 2u * place] = bitcast<f32>(id);
            best[out + 2u * place + 1u] = logit_at(start + id);
        } else {
            best[out + 2u * thread] = bitcast<f32>(0xffffffffu);
            best[out + 2u * thread + 1u] = bitcast<f32>(0x7fc00000u);
        }
    }
}
