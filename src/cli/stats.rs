//! The statistics the benches report: medians, percentiles, spreads, all
//! computed one way.

use serde::Serialize;

/// `values` in ascending order (NaNs last, as `total_cmp` orders them).
pub fn sorted(mut values: Vec<f64>) -> Vec<f64> {
    values.sort_by(f64::total_cmp);
    values
}

/// The nearest-rank percentile `q` (0..=1) of values already sorted; 0 when
/// there are none.
pub fn percentile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let last = sorted.len() - 1;
    let at = ((last as f64 * q.clamp(0.0, 1.0)).round() as usize).min(last);
    sorted[at]
}

/// The median of values already sorted (the mean of the middle two for an
/// even count); 0 when there are none.
pub fn median_of_sorted(sorted: &[f64]) -> f64 {
    match sorted.len() {
        0 => 0.0,
        n if n % 2 == 1 => sorted[n / 2],
        n => (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0,
    }
}

/// The median of values in any order.
pub fn median(values: &[f64]) -> f64 {
    median_of_sorted(&sorted(values.to_vec()))
}

/// The mean; 0 when there are none.
pub fn mean(values: &[f64]) -> f64 {
    if values.is_empty() {
        return 0.0;
    }
    values.iter().sum::<f64>() / values.len() as f64
}

/// `value` rounded to `places` decimals (reports stay readable).
pub fn round_to(value: f64, places: i32) -> f64 {
    let scale = 10f64.powi(places);
    (value * scale).round() / scale
}

/// The smallest, the median and the largest of a set of runs.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Spread {
    pub min: f64,
    pub median: f64,
    pub max: f64,
}

impl Spread {
    /// The spread of `values` (all zero when there are none).
    pub fn of(values: &[f64]) -> Self {
        let sorted = sorted(values.to_vec());
        Self {
            min: sorted.first().copied().unwrap_or(0.0),
            median: median_of_sorted(&sorted),
            max: sorted.last().copied().unwrap_or(0.0),
        }
    }

    /// Every figure rounded to `places` decimals.
    pub fn rounded(self, places: i32) -> Self {
        Self {
            min: round_to(self.min, places),
            median: round_to(self.median, places),
            max: round_to(self.max, places),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_take_the_nearest_rank() {
        let values = sorted((1..=11).rev().map(f64::from).collect());
        assert_eq!(percentile(&values, 0.0), 1.0);
        assert_eq!(percentile(&values, 0.5), 6.0);
        assert_eq!(percentile(&values, 0.9), 10.0);
        assert_eq!(percentile(&values, 0.99), 11.0);
        assert_eq!(percentile(&values, 1.0), 11.0);
        // Out of range asks for an end, never past it.
        assert_eq!(percentile(&values, 1.5), 11.0);
        assert_eq!(percentile(&[], 0.5), 0.0);
    }

    #[test]
    fn medians_average_the_middle_pair_of_an_even_count() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 3.0, 2.0]), 2.5);
        assert_eq!(median(&[]), 0.0);
    }

    #[test]
    fn a_spread_is_min_median_max_and_rounds_each() {
        let spread = Spread::of(&[2.004, 1.0, 9.996]);
        assert_eq!(
            spread,
            Spread {
                min: 1.0,
                median: 2.004,
                max: 9.996
            }
        );
        assert_eq!(
            spread.rounded(2),
            Spread {
                min: 1.0,
                median: 2.0,
                max: 10.0
            }
        );
        assert_eq!(
            Spread::of(&[]),
            Spread {
                min: 0.0,
                median: 0.0,
                max: 0.0
            }
        );
    }

    #[test]
    fn means_and_rounding() {
        assert_eq!(mean(&[1.0, 2.0, 6.0]), 3.0);
        assert_eq!(mean(&[]), 0.0);
        assert_eq!(round_to(1.23456, 3), 1.235);
        assert_eq!(round_to(1.23456, 2), 1.23);
    }
}
