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

fn is_number_char(c: char) -> bool {
    c.is_ascii_digit() || c == '.' || c == ',' || c == '-'
}

/// The answer of `solution`, commas and a `$` removed.
///
/// ```
/// use verl_core::reward_score::gsm8k::{extract_solution, Method};
/// assert_eq!(extract_solution("so 3+4 = 7\n#### 1,200", Method::Strict).as_deref(), Some("1200"));
/// assert_eq!(extract_solution("the answer is 72.", Method::Flexible).as_deref(), Some("72"));
/// assert_eq!(extract_solution("the answer is 72", Method::Strict), None);
/// ```
pub fn extract_solution(solution: &str, method: Method) -> Option<String> {
    let start = solution
        .char_indices()
        .rev()
        .nth(TAIL_CHARS.saturating_sub(1))
        .map_or(0, |(i, _)| i);
    let tail = &solution[start..];
    let clean = |s: &str| s.replace([',', '$'], "");
    match method {
        Method::Strict => {
            // Every "#### <number>" match; the last one counts.
            let mut found = None;
            let mut rest = tail;
            while let Some(i) = rest.find("#### ") {
                let after = &rest[i + 5..];
                let num: String = after
                    .chars()
                    .take_while(|&c| is_number_char(c) || c == '$')
                    .collect();
                let num = clean(&num);
                if num.chars().any(|c| c.is_ascii_digit()) {
                    found = Some(num.trim_end_matches('.').to_string());
                }
                rest = after;
            }
            found
        }
        Method::Flexible => {
            let mut numbers = Vec::new();
            let mut current = String::new();
            for c in tail.chars().chain(std::iter::once(' ')) {
                if is_number_char(c) || (c == '$' && current.is_empty()) {
                    current.push(c);
                } else if !current.is_empty() {
                    numbers.push(std::mem::take(&mut current));
                }
            }
            numbers
                .into_iter()
                .map(|n| clean(&n).trim_end_matches('.').to_string())
                .rfind(|n| n.chars().any(|c| c.is_ascii_digit()))
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
        Some(answer) if answer == ground_truth.trim() => score,
        Some(_) => format_score,
    }
}
