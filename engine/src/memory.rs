//! The process's own memory use, for stats and benchmarks.

/// Peak resident set size (Linux `VmHWM`), if the platform tells.
pub fn peak_rss_bytes() -> Option<u64> {
    status_kib("VmHWM:").map(|kib| kib * 1024)
}

/// Current resident set size (Linux `VmRSS`).
pub fn rss_bytes() -> Option<u64> {
    status_kib("VmRSS:").map(|kib| kib * 1024)
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
}
