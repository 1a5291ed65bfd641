//! The figures an answer states at its end (its token counts, durations, the engine's cache
//! and prefill timings), read from the body's kept tail in one pass.
//!
//! An answer's end is read for some fifteen field names. [`Fields::of`] walks the tail once,
//! from its start, and notes where the value of each known name's last `"name":` starts; each
//! figure is then a lookup. It reads the bytes exactly as a search for the last `"name":`
//! would, JSON or not: a quote followed by `name":` is a match wherever it is, inside a string
//! value too (a tail cut mid-string, or escaped quotes, are read the same way), and the last
//! occurrence wins.

/// A field an answer's end is read for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Field {
    /// Ollama's `total_duration` (nanoseconds).
    TotalDuration,
    /// Ollama's `load_duration` (nanoseconds).
    LoadDuration,
    /// Ollama's `prompt_eval_duration` (nanoseconds).
    PromptEvalDuration,
    /// Ollama's `prompt_eval_count`.
    PromptEvalCount,
    /// Ollama's `eval_count`.
    EvalCount,
    /// OpenAI's `usage.prompt_tokens`.
    PromptTokens,
    /// OpenAI's `usage.completion_tokens`.
    CompletionTokens,
    /// The agents' layers' `input_tokens`.
    InputTokens,
    /// The agents' layers' `output_tokens`.
    OutputTokens,
    /// llama-server's own completion API's `tokens_evaluated`.
    TokensEvaluated,
    /// llama-server's own completion API's `tokens_predicted`.
    TokensPredicted,
    /// Anthropic's `cache_read_input_tokens`.
    CacheReadInputTokens,
    /// Anthropic's `cache_creation_input_tokens`.
    CacheCreationInputTokens,
    /// OpenAI's `prompt_tokens_details.cached_tokens` (and the Responses layer's
    /// `input_tokens_details.cached_tokens`).
    CachedTokens,
    /// llama.cpp's `timings.cache_n`.
    CacheN,
    /// llama.cpp's `timings.prompt_n`.
    PromptN,
    /// llama.cpp's `timings.prompt_ms`.
    PromptMs,
}

impl Field {
    /// Every field, in the order of their index.
    pub const ALL: [Self; 17] = [
        Self::TotalDuration,
        Self::LoadDuration,
        Self::PromptEvalDuration,
        Self::PromptEvalCount,
        Self::EvalCount,
        Self::PromptTokens,
        Self::CompletionTokens,
        Self::InputTokens,
        Self::OutputTokens,
        Self::TokensEvaluated,
        Self::TokensPredicted,
        Self::CacheReadInputTokens,
        Self::CacheCreationInputTokens,
        Self::CachedTokens,
        Self::CacheN,
        Self::PromptN,
        Self::PromptMs,
    ];

    /// The JSON member name it is read from, without its quotes.
    pub fn name(self) -> &'static str {
        match self {
            Self::TotalDuration => "total_duration",
            Self::LoadDuration => "load_duration",
            Self::PromptEvalDuration => "prompt_eval_duration",
            Self::PromptEvalCount => "prompt_eval_count",
            Self::EvalCount => "eval_count",
            Self::PromptTokens => "prompt_tokens",
            Self::CompletionTokens => "completion_tokens",
            Self::InputTokens => "input_tokens",
            Self::OutputTokens => "output_tokens",
            Self::TokensEvaluated => "tokens_evaluated",
            Self::TokensPredicted => "tokens_predicted",
            Self::CacheReadInputTokens => "cache_read_input_tokens",
            Self::CacheCreationInputTokens => "cache_creation_input_tokens",
            Self::CachedTokens => "cached_tokens",
            Self::CacheN => "cache_n",
            Self::PromptN => "prompt_n",
            Self::PromptMs => "prompt_ms",
        }
    }

    /// The field a JSON member name (without its quotes) is, if it is one: [`Field::name`]
    /// turned round, as one `match` (a lookup for each name in the tail).
    fn named(name: &[u8]) -> Option<Self> {
        Some(match name {
            b"total_duration" => Self::TotalDuration,
            b"load_duration" => Self::LoadDuration,
            b"prompt_eval_duration" => Self::PromptEvalDuration,
            b"prompt_eval_count" => Self::PromptEvalCount,
            b"eval_count" => Self::EvalCount,
            b"prompt_tokens" => Self::PromptTokens,
            b"completion_tokens" => Self::CompletionTokens,
            b"input_tokens" => Self::InputTokens,
            b"output_tokens" => Self::OutputTokens,
            b"tokens_evaluated" => Self::TokensEvaluated,
            b"tokens_predicted" => Self::TokensPredicted,
            b"cache_read_input_tokens" => Self::CacheReadInputTokens,
            b"cache_creation_input_tokens" => Self::CacheCreationInputTokens,
            b"cached_tokens" => Self::CachedTokens,
            b"cache_n" => Self::CacheN,
            b"prompt_n" => Self::PromptN,
            b"prompt_ms" => Self::PromptMs,
            _ => return None,
        })
    }
}

/// Where the value of each [`Field`]'s last `"name":` starts in a body's kept tail.
#[derive(Debug, Clone, Copy)]
pub struct Fields<'a> {
    tail: &'a [u8],
    /// Indexed by `Field as usize`: the offset just after the colon.
    values: [Option<usize>; Field::ALL.len()],
}

impl<'a> Fields<'a> {
    /// Indexes `tail` in one pass. A field name is the text between two consecutive quotes
    /// of which the second is followed by a colon: every quote is a possible opening one,
    /// so that a tail starting mid-string, or a quote escaped inside a value, is read as a
    /// backward search for `"name":` would read it.
    pub fn of(tail: &'a [u8]) -> Self {
        let mut values = [None; Field::ALL.len()];
        let mut opening: Option<usize> = None;
        let mut from = 0;
        while let Some(found) = tail[from..].iter().position(|&byte| byte == b'"') {
            let quote = from + found;
            if tail.get(quote + 1) == Some(&b':')
                && let Some(field) = opening.and_then(|open| Field::named(&tail[open + 1..quote]))
                && let Some(value) = values.get_mut(field as usize)
            {
                *value = Some(quote + 2);
            }
            opening = Some(quote);
            from = quote + 1;
        }
        Self { tail, values }
    }

    /// The text from the start of `field`'s last value to the end of the tail.
    fn value(&self, field: Field) -> Option<&'a [u8]> {
        let start = (*self.values.get(field as usize)?)?;
        Some(self.tail[start..].trim_ascii_start())
    }

    /// The unsigned integer that `field`'s last occurrence has for value: `None` when the
    /// tail has no such field, when its value does not start with a digit, or when it is
    /// more than a `u64` holds (as `str::parse` says).
    pub fn number(&self, field: Field) -> Option<u64> {
        let value = self.value(field)?;
        let digits = value
            .iter()
            .position(|byte| !byte.is_ascii_digit())
            .unwrap_or(value.len());
        if digits == 0 {
            return None;
        }
        value[..digits].iter().try_fold(0u64, |number, digit| {
            number.checked_mul(10)?.checked_add(u64::from(digit - b'0'))
        })
    }

    /// The number (decimal point and exponent allowed) that `field`'s last occurrence has
    /// for value, if it parses as an `f64`.
    pub fn decimal(&self, field: Field) -> Option<f64> {
        let value = self.value(field)?;
        let length = value
            .iter()
            .position(|byte| {
                !(byte.is_ascii_digit() || matches!(byte, b'.' | b'e' | b'E' | b'-' | b'+'))
            })
            .unwrap_or(value.len());
        std::str::from_utf8(&value[..length]).ok()?.parse().ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The reading the index replaced: the number after the last occurrence of
    /// `"name":`, found by a backward search.
    fn searched(tail: &[u8], name: &str) -> Option<u64> {
        let needle = format!("\"{name}\":");
        let at = tail
            .windows(needle.len())
            .rposition(|window| window == needle.as_bytes())?;
        let value = tail[at + needle.len()..].trim_ascii_start();
        let digits: String = value
            .iter()
            .take_while(|byte| byte.is_ascii_digit())
            .map(|byte| char::from(*byte))
            .collect();
        digits.parse().ok()
    }

    #[test]
    fn each_field_is_read_at_its_last_name_as_a_backward_search_reads_it() {
        use Field::EvalCount;
        let table: [(&[u8], Option<u64>); 14] = [
            (br#"{"eval_count":1}{"eval_count": 42,"eval":7}"#, Some(42)),
            // A field name inside a string value, escaped as JSON writes it, is none (a
            // backslash stands before its closing quote); one whose opening quote is an
            // escaped one is: the bytes are read, not the JSON.
            (
                br#"{"eval_count":1,"response":"\"eval_count\":9"}"#,
                Some(1),
            ),
            (br#"{"eval_count":1,"response":"\"eval_count":3"}"#, Some(3)),
            // A tail that starts mid-string: its first quote closes a string.
            (br#"ing","eval_count":5}"#, Some(5)),
            (br#"eval_count":5,"done":true}"#, None),
            (br#"a"eval_count":6}"#, Some(6)),
            // A name that only ends like the field's, or a quote doubled before it.
            (br#"{"prompt_eval_count":8}"#, None),
            (br#"{""eval_count":4}"#, Some(4)),
            // No digits, too many for a u64, u64::MAX, a field cut at the end.
            (br#"{"eval_count":"1"}"#, None),
            (br#"{"eval_count":18446744073709551616}"#, None),
            (br#"{"eval_count":18446744073709551615}"#, Some(u64::MAX)),
            (br#"{"eval_count""#, None),
            (br#"{"eval_count":"#, None),
            // The last occurrence wins even when it holds no number.
            (br#"{"eval_count":3},{"eval_count":null}"#, None),
        ];
        for (tail, expected) in table {
            let text = String::from_utf8_lossy(tail);
            assert_eq!(Fields::of(tail).number(EvalCount), expected, "{text}");
            assert_eq!(searched(tail, "eval_count"), expected, "{text}");
        }
    }

    #[test]
    fn every_field_is_indexed_in_one_pass() {
        let tail = br#"data: {"usage":{"prompt_tokens":1296,"completion_tokens":7,"prompt_tokens_details":{"cached_tokens":908}},"timings":{"cache_n":908,"prompt_n":388,"prompt_ms":1241.6},"total_duration":1,"load_duration":2,"prompt_eval_duration":3,"prompt_eval_count":4,"eval_count":5,"input_tokens":6,"output_tokens":8,"tokens_evaluated":9,"tokens_predicted":10,"cache_read_input_tokens":11,"cache_creation_input_tokens":12}"#;
        let fields = Fields::of(tail);
        for (index, field) in Field::ALL.into_iter().enumerate() {
            let name = field.name();
            assert_eq!(field as usize, index, "{name}");
            assert_eq!(Field::named(name.as_bytes()), Some(field));
            assert!(fields.number(field).is_some(), "{name}");
            assert_eq!(fields.number(field), searched(tail, name), "{name}");
        }
        assert_eq!(fields.decimal(Field::PromptMs), Some(1241.6));
        assert_eq!(fields.number(Field::PromptMs), Some(1241));
        assert_eq!(
            Fields::of(b"{\"done\":true}").number(Field::EvalCount),
            None
        );
        assert_eq!(Fields::of(b"").number(Field::EvalCount), None);
        assert_eq!(Fields::of(b"\"").number(Field::EvalCount), None);
    }

    /// Pieces a tail is made of: whole field names, stray and escaped quotes, colons, names
    /// in part, numbers (one past `u64::MAX` too).
    const PIECES: [&str; 16] = [
        "\"eval_count\":",
        "\"prompt_n\":",
        "\"cache_read_input_tokens\":",
        "\"",
        "\\\"",
        "\":",
        ":",
        " ",
        ",",
        "7",
        "42",
        "18446744073709551616",
        "null",
        "eval_count",
        "prompt_",
        "n",
    ];

    proptest::proptest! {
        #[test]
        fn any_tail_is_read_as_a_backward_search_reads_it(
            picks in proptest::collection::vec(0..PIECES.len(), 0..64),
        ) {
            let tail: String = picks.iter().map(|&pick| PIECES[pick]).collect();
            let fields = Fields::of(tail.as_bytes());
            for field in Field::ALL {
                proptest::prop_assert_eq!(
                    fields.number(field),
                    searched(tail.as_bytes(), field.name()),
                    "{} in {}",
                    field.name(),
                    tail
                );
            }
        }
    }
}
