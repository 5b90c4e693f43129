//! Streaming detokenizer buffer: turns the raw bytes of tokens into text.
//!
//! A byte-level BPE token is not always a whole character: an emoji or a CJK
//! character is often split over two to four tokens, so decoding each token on
//! its own would print replacement characters in the middle of valid text.
//! [`Utf8Stream`] holds back the bytes of an unfinished character until the
//! token that completes it arrives, and replaces bytes that can never become
//! valid with U+FFFD (exactly as [`String::from_utf8_lossy`] would) so that one
//! bad token never stalls the stream.

/// The Unicode replacement character, emitted for bytes that are not UTF-8.
const REPLACEMENT: char = '\u{FFFD}';

/// Byte buffer that emits the longest complete, valid UTF-8 prefix of what it
/// has been given.
///
/// At most three bytes (an unfinished four-byte sequence) are ever held back.
/// The buffer is reused between pushes, so after the first token
/// [`Utf8Stream::push_into`] does not allocate.
#[derive(Clone, Debug, Default)]
pub struct Utf8Stream {
    /// Bytes received but not yet emitted: always empty or the beginning of a
    /// valid but incomplete sequence between pushes.
    pending: Vec<u8>,
}

impl Utf8Stream {
    /// An empty stream.
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends the raw bytes of one token and returns the text that is now
    /// complete (possibly empty).
    ///
    /// Convenience wrapper over [`Utf8Stream::push_into`], which appends to a
    /// caller-owned `String` instead and so avoids one allocation per token.
    pub fn push(&mut self, bytes: &[u8]) -> String {
        let mut text = String::new();
        self.push_into(bytes, &mut text);
        text
    }

    /// Appends the raw bytes of one token and appends the text that is now
    /// complete to `out`.
    ///
    /// Bytes that begin a valid but incomplete sequence are held back; bytes
    /// that can never become valid are written as U+FFFD, one per maximal
    /// invalid subpart (the same policy as [`String::from_utf8_lossy`]).
    pub fn push_into(&mut self, bytes: &[u8], out: &mut String) {
        if self.pending.is_empty() {
            // Common case: no unfinished character, decode the token directly.
            let consumed = decode_complete_prefix(bytes, out);
            self.pending.extend_from_slice(&bytes[consumed..]);
        } else {
            self.pending.extend_from_slice(bytes);
            let consumed = decode_complete_prefix(&self.pending, out);
            self.pending.drain(..consumed);
        }
    }

    /// Whether bytes of an unfinished character are being held back.
    pub fn has_pending(&self) -> bool {
        !self.pending.is_empty()
    }

    /// End of generation: returns whatever is held back, lossily (an unfinished
    /// character becomes U+FFFD), and leaves the stream empty.
    pub fn finish(&mut self) -> String {
        let text = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        text
    }
}

/// Decodes `bytes` into `out`, replacing invalid subparts with U+FFFD, and
/// stops before a trailing valid-but-incomplete sequence. Returns how many
/// bytes were consumed.
fn decode_complete_prefix(bytes: &[u8], out: &mut String) -> usize {
    let mut position = 0;
    while position < bytes.len() {
        match std::str::from_utf8(&bytes[position..]) {
            Ok(text) => {
                out.push_str(text);
                return bytes.len();
            }
            Err(error) => {
                let valid_len = error.valid_up_to();
                // The prefix up to `valid_up_to` is valid UTF-8 by definition,
                // so this conversion cannot fail; matching keeps it panic-free.
                if let Ok(valid) = std::str::from_utf8(&bytes[position..position + valid_len]) {
                    out.push_str(valid);
                }
                position += valid_len;
                match error.error_len() {
                    Some(invalid_len) => {
                        out.push(REPLACEMENT);
                        position += invalid_len;
                    }
                    // The rest is the start of a character that later bytes
                    // may complete: hold it back.
                    None => return position,
                }
            }
        }
    }
    position
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn four_byte_emoji_split_over_four_pushes_waits_until_complete() {
        let emoji = "😀".as_bytes();
        assert_eq!(emoji.len(), 4);
        let mut stream = Utf8Stream::new();
        assert_eq!(stream.push(&emoji[..1]), "");
        assert_eq!(stream.push(&emoji[1..2]), "");
        assert_eq!(stream.push(&emoji[2..3]), "");
        assert!(stream.has_pending());
        assert_eq!(stream.push(&emoji[3..]), "😀");
        assert!(!stream.has_pending());
        assert_eq!(stream.finish(), "");
    }

    #[test]
    fn mixed_ascii_and_split_multibyte() {
        let mut stream = Utf8Stream::new();
        let bytes = "héllo 世界!".as_bytes();
        let mut text = String::new();
        for byte in bytes {
            stream.push_into(std::slice::from_ref(byte), &mut text);
        }
        assert_eq!(text, "héllo 世界!");
        // Complete text plus the start of the next character in one push.
        let mut stream = Utf8Stream::new();
        let cjk = "世".as_bytes();
        let mut token = b"ab".to_vec();
        token.extend_from_slice(&cjk[..2]);
        assert_eq!(stream.push(&token), "ab");
        assert_eq!(stream.push(&cjk[2..]), "世");
    }

    #[test]
    fn invalid_bytes_become_replacement_and_do_not_block() {
        let mut stream = Utf8Stream::new();
        assert_eq!(stream.push(b"a\xFFb"), "a\u{FFFD}b");
        // A lone continuation byte can never start a character.
        assert_eq!(stream.push(b"\x80"), "\u{FFFD}");
        // A lead byte followed by a non-continuation byte is invalid at once.
        assert_eq!(stream.push(b"\xE4"), "");
        assert_eq!(stream.push(b"x"), "\u{FFFD}x");
        assert_eq!(stream.push("ok".as_bytes()), "ok");
    }

    #[test]
    fn matches_from_utf8_lossy_on_arbitrary_splits() {
        let samples: [&[u8]; 4] = [
            b"plain ascii",
            "ß∑😀🇩🇪".as_bytes(),
            b"\xF0\x9F\x98 broken \xED\xA0\x80 surrogate \xC0\xAF overlong",
            b"\xE2\x82\xAC\xF4\x90\x80\x80 end \xE2\x82",
        ];
        for sample in samples {
            let expected = String::from_utf8_lossy(sample);
            for chunk_len in 1..=5 {
                let mut stream = Utf8Stream::new();
                let mut text = String::new();
                for chunk in sample.chunks(chunk_len) {
                    stream.push_into(chunk, &mut text);
                }
                text.push_str(&stream.finish());
                assert_eq!(text, expected, "chunk length {chunk_len}");
            }
        }
    }

    #[test]
    fn finish_flushes_unfinished_character_lossily() {
        let mut stream = Utf8Stream::new();
        assert_eq!(stream.push(&"😀".as_bytes()[..2]), "");
        assert_eq!(stream.finish(), "\u{FFFD}");
        assert!(!stream.has_pending());
        assert_eq!(stream.push(b"next"), "next");
    }
}
