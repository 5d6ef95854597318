//! GSM8K scoring as verl scores it: the answer is the number after the last `#### ` (strict) or
//! the last number in the text (flexible); a match scores `score`, a found but wrong answer
//! `format_score`, no answer 0.

/// How the answer is found in the solution.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Method {
    /// The number after the last `#### `.
    Strict,
    /// The last number anywhere in the text.
    Flexible,
}

/// verl's scorer only looks at the last 300 characters (long solutions do not slow it down).
const TAIL_CHARS: usize = 300;

fn in_number(c: char) -> bool {
    c.is_ascii_digit() || c == '.' || c == ','
}

/// The end of a match of `-?[0-9.,]+` starting at byte `at` of `text`, if one starts there.
fn number_at(text: &str, at: usize) -> Option<usize> {
    let rest = &text[at..];
    let body = rest
        .strip_prefix('-')
        .filter(|r| r.starts_with(in_number))
        .unwrap_or(rest);
    let run = body.find(|c: char| !in_number(c)).unwrap_or(body.len());
    (run > 0).then(|| at + (rest.len() - body.len()) + run)
}

/// Python's `re.findall` of `prefix(-?[0-9.,]+)` over `text`: leftmost, non-overlapping.
fn find_numbers<'a>(text: &'a str, prefix: &str) -> Vec<&'a str> {
    let mut found = Vec::new();
    let mut at = 0;
    while at < text.len() {
        let start = at + prefix.len();
        match text[at..]
            .starts_with(prefix)
            .then(|| number_at(text, start))
            .flatten()
        {
            Some(end) => {
                found.push(&text[start..end]);
                at = end;
            }
            None => at += text[at..].chars().next().map_or(1, char::len_utf8),
        }
    }
    found
}

/// The answer of `solution` as verl's `extract_solution` finds it in the last 300 characters:
/// strict, the last `#### <number>` with commas and `$` removed; flexible, the last match of
/// `-?[0-9.,]+` that is not `.` (as matched: commas kept), or the first match when all are.
///
/// ```
/// use verl_core::reward_score::gsm8k::{extract_solution, Method};
/// assert_eq!(extract_solution("so 3+4 = 7\n#### 1,200", Method::Strict).as_deref(), Some("1200"));
/// assert_eq!(extract_solution("the answer is 72.", Method::Flexible).as_deref(), Some("72."));
/// assert_eq!(extract_solution("the answer is 72", Method::Strict), None);
/// ```
pub fn extract_solution(solution: &str, method: Method) -> Option<String> {
    let start = solution
        .char_indices()
        .rev()
        .nth(TAIL_CHARS.saturating_sub(1))
        .map_or(0, |(i, _)| i);
    let tail = &solution[start..];
    match method {
        Method::Strict => find_numbers(tail, "#### ")
            .last()
            .map(|n| n.replace([',', '$'], "")),
        Method::Flexible => {
            let numbers = find_numbers(tail, "");
            // Python's loop variable keeps the last value tried: the first match when every
            // one is ".".
            numbers
                .iter()
                .rev()
                .find(|n| **n != ".")
                .or(numbers.first())
                .map(|n| n.to_string())
        }
    }
}

/// `score` when the extracted answer equals `ground_truth`, `format_score` when an answer was
/// found but differs, 0 when none was found.
///
/// ```
/// use verl_core::reward_score::gsm8k::{compute_score, Method};
/// assert_eq!(compute_score("... #### 18", "18", Method::Strict, 0.0, 1.0), 1.0);
/// assert_eq!(compute_score("... #### 17", "18", Method::Strict, 0.1, 1.0), 0.1);
/// assert_eq!(compute_score("18", "18", Method::Strict, 0.1, 1.0), 0.0);
/// assert_eq!(compute_score("so it is 18", "18", Method::Flexible, 0.0, 1.0), 1.0);
/// ```
pub fn compute_score(
    solution: &str,
    ground_truth: &str,
    method: Method,
    format_score: f64,
    score: f64,
) -> f64 {
    match extract_solution(solution, method) {
        None => 0.0,
        Some(answer) if answer == ground_truth => score,
        Some(_) => format_score,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each case worked through verl's regexes by hand (Python's `re.findall`).
    #[test]
    fn extraction_follows_verls_regexes() {
        let strict = |s: &str| extract_solution(s, Method::Strict);
        let flexible = |s: &str| extract_solution(s, Method::Flexible);
        assert_eq!(strict("#### 1,2,3").as_deref(), Some("123"));
        assert_eq!(strict("#### 18.").as_deref(), Some("18."));
        assert_eq!(strict("#### -5").as_deref(), Some("-5"));
        assert_eq!(strict("#### ."), Some(".".into()));
        assert_eq!(strict("#### $18"), None); // `$` is not in the number's class
        assert_eq!(strict("##### 5 then #### 7").as_deref(), Some("7"));
        assert_eq!(strict("#### - 5"), None);
        assert_eq!(flexible("1,200").as_deref(), Some("1,200"));
        assert_eq!(flexible("it is 72.").as_deref(), Some("72."));
        assert_eq!(flexible("3-4").as_deref(), Some("-4"));
        assert_eq!(flexible("x . y .").as_deref(), Some("."));
        assert_eq!(flexible("a, b").as_deref(), Some(","));
        assert_eq!(flexible("7 and ."), Some("7".into()));
        assert_eq!(flexible("none"), None);
        // Only the last 300 characters are read.
        let long = format!("#### 5{}", " ".repeat(300));
        assert_eq!(strict(&long), None);
        assert_eq!(
            strict(&format!("{}#### 5", "é".repeat(400))).as_deref(),
            Some("5")
        );
    }

    #[test]
    fn the_ground_truth_is_compared_as_given() {
        assert_eq!(
            compute_score("#### 18", "18", Method::Strict, 0.1, 1.0),
            1.0
        );
        assert_eq!(
            compute_score("#### 18", " 18", Method::Strict, 0.1, 1.0),
            0.1
        );
        assert_eq!(
            compute_score("#### 1,800", "1800", Method::Strict, 0.1, 1.0),
            1.0
        );
        assert_eq!(
            compute_score("1,800", "1800", Method::Flexible, 0.1, 1.0),
            0.1
        );
    }
}
