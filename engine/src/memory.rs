//! The process's own memory use, for stats and benchmarks.

/// Peak resident set size (Linux `VmHWM`), if the platform tells.
pub fn peak_rss_bytes() -> Option<u64> {
    status_kib("VmHWM:").map(|kib| kib * 1024)
}

/// Current resident set size (Linux `VmRSS`).
pub fn rss_bytes() -> Option<u64> {
    status_kib("VmRSS:").map(|kib| kib * 1024)
}

/// Bytes [`read_bandwidth`] reads: far more than any CPU's caches hold.
const BANDWIDTH_BYTES: usize = 512 << 20;

/// The memory read bandwidth, bytes/s, that `pool`'s threads reach
/// together summing a buffer far larger than the caches: the physical
/// limit of a decode step, which reads every weight once. The fastest of
/// four passes (load from elsewhere only ever slows a pass). It allocates
/// and touches 512 MiB, so read the peak RSS before calling it.
pub fn read_bandwidth(pool: &crate::threadpool::ThreadPool) -> f64 {
    let words = vec![1u64; BANDWIDTH_BYTES / 8];
    let threads = pool.threads().max(1);
    let per_thread = words.len().div_ceil(threads);
    let mut fastest = f64::INFINITY;
    for _ in 0..4 {
        let start = std::time::Instant::now();
        pool.run(|index, _| {
            let from = (index * per_thread).min(words.len());
            let to = (from + per_thread).min(words.len());
            std::hint::black_box(sum_words(&words[from..to]));
        });
        fastest = fastest.min(start.elapsed().as_secs_f64());
    }
    BANDWIDTH_BYTES as f64 / fastest
}

/// A sum in eight independent lanes, so the loads are not serialized by
/// one chain of additions.
fn sum_words(words: &[u64]) -> u64 {
    let mut lanes = [0u64; 8];
    let chunks = words.chunks_exact(8);
    let rest = chunks.remainder();
    for chunk in chunks {
        for (lane, word) in lanes.iter_mut().zip(chunk) {
            *lane = lane.wrapping_add(*word);
        }
    }
    lanes.iter().chain(rest).fold(0, |a, b| a.wrapping_add(*b))
}

fn status_kib(field: &str) -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    status
        .lines()
        .find_map(|line| line.strip_prefix(field))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|kib| kib.parse().ok())
}

#[cfg(test)]
mod tests {
    #[test]
    #[cfg(target_os = "linux")]
    fn linux_reports_memory() {
        // Current first: the peak read after it can only be as large or larger.
        let now = super::rss_bytes().unwrap_or(0);
        let peak = super::peak_rss_bytes().unwrap_or(0);
        assert!(now > 0 && peak >= now);
    }

    #[test]
    fn the_bandwidth_sum_reads_every_word() {
        let words: Vec<u64> = (1..=1003).collect();
        assert_eq!(super::sum_words(&words), 1003 * 1004 / 2);
    }
}
