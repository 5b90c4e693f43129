//! Rate-limited logging: a message that can repeat thousands of times a
//! second (an event refused in a loop, a peer that keeps sending garbage) is
//! said at most once a period per kind, with the count of those not said.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

pub struct Throttle {
    period: Duration,
    /// Per kind: when it was last said, and how many were held back since.
    kinds: BTreeMap<&'static str, (Instant, u64)>,
}

impl Throttle {
    pub fn new(period: Duration) -> Self {
        Self {
            period,
            kinds: BTreeMap::new(),
        }
    }

    /// Whether a message of `kind` may be logged now. When it may after
    /// some were held back, their count is logged first.
    pub fn allow(&mut self, kind: &'static str) -> bool {
        self.allow_at(kind, Instant::now())
    }

    fn allow_at(&mut self, kind: &'static str, now: Instant) -> bool {
        match self.kinds.get_mut(kind) {
            Some((said, held)) if now.duration_since(*said) < self.period => {
                *held += 1;
                false
            }
            Some((said, held)) => {
                if *held > 0 {
                    tracing::warn!(
                        kind,
                        repeats = *held,
                        "messages like the next were held back"
                    );
                }
                *said = now;
                *held = 0;
                true
            }
            None => {
                self.kinds.insert(kind, (now, 0));
                true
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_kind_is_said_once_a_period() {
        let mut throttle = Throttle::new(Duration::from_secs(5));
        let start = Instant::now();
        assert!(throttle.allow_at("a", start));
        assert!(!throttle.allow_at("a", start + Duration::from_secs(1)));
        assert!(throttle.allow_at("b", start + Duration::from_secs(1)));
        assert!(throttle.allow_at("a", start + Duration::from_secs(5)));
        assert_eq!(throttle.kinds["a"].1, 0);
    }
}
