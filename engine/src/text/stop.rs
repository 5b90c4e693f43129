//! Stop strings over streamed text.
//!
//! A stop string may arrive split over several tokens ("</", "en", "d>"), so
//! text that could be the beginning of a stop string is held back until the
//! next pieces show whether it is one. Nothing from the start of a matched
//! stop string onwards is ever emitted, which is what OpenAI-compatible
//! clients expect (`stop` sequences are not part of the returned text).

/// What one [`StopMatcher::push`] produced.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StopOutcome {
    /// Text that is now known not to belong to a stop string.
    pub emit: String,
    /// Index (into the list given to [`StopMatcher::new`]) of the stop string
    /// that matched, if one did. Generation should end.
    pub stopped: Option<usize>,
}

/// Finds stop strings in text that arrives in pieces.
#[derive(Clone, Debug, Default)]
pub struct StopMatcher {
    /// Non-empty stop strings, each with its index in the caller's list (kept
    /// so that ignoring empty strings does not shift the reported index).
    stops: Vec<(usize, String)>,
    /// Text received but not yet emitted: between pushes, always a suffix that
    /// is a proper prefix of some stop string.
    held: String,
    /// The stop string that matched, once one has: later pushes emit nothing.
    stopped: Option<usize>,
}

impl StopMatcher {
    /// A matcher for `stops`; empty strings are ignored because they would
    /// match before any text.
    pub fn new(stops: Vec<String>) -> Self {
        let stops = stops
            .into_iter()
            .enumerate()
            .filter(|(_, stop)| !stop.is_empty())
            .collect();
        Self {
            stops,
            held: String::new(),
            stopped: None,
        }
    }

    /// Whether there are no (non-empty) stop strings, so every push passes its
    /// text straight through.
    pub fn is_empty(&self) -> bool {
        self.stops.is_empty()
    }

    /// Feeds newly decoded text; returns the text that is now safe to emit and
    /// whether a stop string was hit.
    ///
    /// When several stop strings occur, the one that starts earliest in the
    /// text wins (on a tie, the one listed first). Once a stop string has
    /// matched, later pushes emit nothing and report the same index again.
    pub fn push(&mut self, text: &str) -> StopOutcome {
        if self.stopped.is_some() {
            return StopOutcome {
                emit: String::new(),
                stopped: self.stopped,
            };
        }
        if self.stops.is_empty() {
            return StopOutcome {
                emit: text.to_owned(),
                stopped: None,
            };
        }
        self.held.push_str(text);

        // The held text held no complete stop string before this push, so any
        // match found now ends in the new text; searching all of `held` (a
        // short suffix plus `text`) is both simple and cheap.
        if let Some((start, index)) = self.earliest_match() {
            self.held.truncate(start);
            self.stopped = Some(index);
            return StopOutcome {
                emit: std::mem::take(&mut self.held),
                stopped: Some(index),
            };
        }

        let keep_from = self.start_of_possible_stop_prefix();
        let emit = self.held[..keep_from].to_owned();
        self.held.replace_range(..keep_from, "");
        StopOutcome {
            emit,
            stopped: None,
        }
    }

    /// End of generation: releases whatever is held back (nothing, if a stop
    /// string matched) and makes the matcher ready for a new stream.
    pub fn finish(&mut self) -> String {
        self.stopped = None;
        std::mem::take(&mut self.held)
    }

    /// Byte offset and caller index of the earliest complete stop string in
    /// the held text.
    fn earliest_match(&self) -> Option<(usize, usize)> {
        let mut best: Option<(usize, usize)> = None;
        for (index, stop) in &self.stops {
            if let Some(start) = self.held.find(stop.as_str()) {
                if best.is_none_or(|(best_start, _)| start < best_start) {
                    best = Some((start, *index));
                }
            }
        }
        best
    }

    /// Where the longest suffix of the held text that is a proper prefix of
    /// some stop string begins (the held text's length when there is none).
    /// Only char boundaries are considered, so a character is never split.
    fn start_of_possible_stop_prefix(&self) -> usize {
        let longest_stop = self.stops.iter().map(|(_, s)| s.len()).max().unwrap_or(0);
        // A proper prefix is at most `longest_stop - 1` bytes long.
        let earliest = self
            .held
            .len()
            .saturating_sub(longest_stop.saturating_sub(1));
        (earliest..self.held.len())
            .filter(|&offset| self.held.is_char_boundary(offset))
            .find(|&offset| {
                let suffix = &self.held[offset..];
                self.stops.iter().any(|(_, stop)| stop.starts_with(suffix))
            })
            .unwrap_or(self.held.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn matcher(stops: &[&str]) -> StopMatcher {
        StopMatcher::new(stops.iter().map(|s| s.to_string()).collect())
    }

    /// Pushes each piece, returning the concatenated emitted text and the stop.
    fn run(m: &mut StopMatcher, pieces: &[&str]) -> (String, Option<usize>) {
        let mut text = String::new();
        let mut stopped = None;
        for piece in pieces {
            let outcome = m.push(piece);
            text.push_str(&outcome.emit);
            if outcome.stopped.is_some() {
                stopped = outcome.stopped;
                break;
            }
        }
        if stopped.is_none() {
            text.push_str(&m.finish());
        }
        (text, stopped)
    }

    #[test]
    fn stop_split_across_many_pushes() {
        let mut m = matcher(&["</end>"]);
        let first = m.push("hello </");
        assert_eq!(first.emit, "hello ");
        assert_eq!(first.stopped, None);
        let second = m.push("en");
        assert_eq!(second.emit, "");
        let third = m.push("d> ignored");
        assert_eq!(third.emit, "");
        assert_eq!(third.stopped, Some(0));
        assert_eq!(m.push("more").emit, "");
        assert_eq!(m.finish(), "");
    }

    #[test]
    fn held_prefix_released_when_it_turns_out_not_to_be_a_stop() {
        let mut m = matcher(&["</end>"]);
        assert_eq!(m.push("a </e").emit, "a ");
        assert_eq!(m.push("x").emit, "</ex");
        assert_eq!(m.push("</").emit, "");
        assert_eq!(m.finish(), "</");
    }

    #[test]
    fn earliest_match_wins_and_index_is_reported() {
        let mut m = matcher(&["world", "lo"]);
        assert_eq!(run(&mut m, &["hello world"]), ("hel".to_string(), Some(1)));
        // Same start: the first listed wins.
        let mut m = matcher(&["ab", "abc"]);
        assert_eq!(run(&mut m, &["xabc"]), ("x".to_string(), Some(0)));
        // A later-starting stop completing first in the stream does not beat
        // an earlier one completing in the same push.
        let mut m = matcher(&["STOP", "OP!"]);
        assert_eq!(run(&mut m, &["go ST", "OP!"]), ("go ".to_string(), Some(0)));
    }

    #[test]
    fn empty_stop_strings_are_ignored_without_shifting_indices() {
        let mut m = matcher(&["", "end"]);
        assert!(!m.is_empty());
        assert_eq!(run(&mut m, &["the e", "nd"]), ("the ".to_string(), Some(1)));
        let mut none = matcher(&[""]);
        assert!(none.is_empty());
        assert_eq!(none.push("text").emit, "text");
    }

    #[test]
    fn overlapping_prefixes() {
        let mut m = matcher(&["aab"]);
        assert_eq!(
            run(&mut m, &["xa", "a", "a", "b"]),
            ("xa".to_string(), Some(0))
        );
        let mut m = matcher(&["abab"]);
        assert_eq!(run(&mut m, &["ab", "ab", "ab"]), (String::new(), Some(0)));
        let mut m = matcher(&["abab"]);
        assert_eq!(
            run(&mut m, &["aba", "cabab"]),
            ("abac".to_string(), Some(0))
        );
        let mut m = matcher(&["\n\n", "\nUser:"]);
        assert_eq!(
            run(&mut m, &["ok\n", "Us", "er:"]),
            ("ok".to_string(), Some(1))
        );
    }

    #[test]
    fn multibyte_text_is_never_split() {
        let mut m = matcher(&["终止", "é!"]);
        let outcome = m.push("日本語 終");
        assert_eq!(outcome.emit, "日本語 終");
        let outcome = m.push("止 终");
        assert_eq!(outcome.emit, "止 ");
        let outcome = m.push("止 after");
        assert_eq!(outcome.emit, "");
        assert_eq!(outcome.stopped, Some(0));

        // A stop whose first character shares a leading byte with the text.
        let mut m = matcher(&["é!"]);
        let outcome = m.push("café");
        assert_eq!(outcome.emit, "caf");
        assert_eq!(m.push("?").emit, "é?");
        assert_eq!(
            run(&mut matcher(&["😀x"]), &["a😀", "x"]),
            ("a".to_string(), Some(0))
        );
    }

    #[test]
    fn no_stop_passes_everything_through_eventually() {
        let mut m = matcher(&["###"]);
        let text = "a # b ## c #";
        let (out, stopped) = run(&mut m, &text.split_inclusive(' ').collect::<Vec<_>>());
        assert_eq!(out, text);
        assert_eq!(stopped, None);
    }
}
