//! OmegaConf's value syntax, as verl's YAML files use it: `${a.b}` (a key's value),
//! `${.x}` / `${..x}` (a key beside this one / beside its section), `${oc.select:a.b,default}`
//! (a key's value, or the default where the key does not exist), text with interpolations inside
//! (`checkpoints/${trainer.project_name}`), and `_target_` keys (Hydra's class names, which mean
//! nothing here). Resolved once over the whole tree, after the file and the overrides.
//!
//! ```
//! use serde_json::json;
//! use verl_core::config::resolve_interpolations;
//!
//! let mut tree = json!({
//!     "data": {"max_prompt_length": 512},
//!     "rollout": {"prompt_length": "${oc.select:data.max_prompt_length,256}",
//!                 "dir": "runs/${.prompt_length}", "_target_": "verl.Thing"},
//! });
//! resolve_interpolations(&mut tree).unwrap();
//! assert_eq!(tree["rollout"], json!({"prompt_length": 512, "dir": "runs/512"}));
//! ```

use serde_json::{Map, Value};

use crate::error::ConfigError;

/// References followed from one value at most (a longer chain is a cycle).
const MAX_DEPTH: usize = 32;

/// Removes `_target_` keys and replaces every interpolation by its value, in place. An
/// interpolation that names a key that does not exist, or a cycle, is an error naming the key
/// that holds it.
pub fn resolve_interpolations(tree: &mut Value) -> Result<(), ConfigError> {
    strip_targets(tree);
    let original = tree.clone();
    let mut at = Vec::new();
    resolve_in(tree, &original, &mut at)
}

/// Removes Hydra's `_target_` keys at every depth.
pub(crate) fn strip_targets(v: &mut Value) {
    match v {
        Value::Object(m) => {
            m.remove("_target_");
            m.values_mut().for_each(strip_targets);
        }
        Value::Array(a) => a.iter_mut().for_each(strip_targets),
        _ => {}
    }
}

/// Resolves every string under `v` (at path `at` in `root`).
fn resolve_in(v: &mut Value, root: &Value, at: &mut Vec<String>) -> Result<(), ConfigError> {
    match v {
        Value::Object(m) => {
            for (k, child) in m.iter_mut() {
                at.push(k.clone());
                resolve_in(child, root, at)?;
                at.pop();
            }
        }
        Value::Array(a) => {
            for child in a.iter_mut() {
                resolve_in(child, root, at)?;
            }
        }
        Value::String(s) if s.contains("${") => {
            *v = resolve_text(s, root, at, 0)?;
        }
        _ => {}
    }
    Ok(())
}

fn error(at: &[String], message: String) -> ConfigError {
    ConfigError::Key {
        key: at.join("."),
        message,
    }
}

/// The value of text `s` held at `at`: one interpolation alone keeps the referenced value's
/// type; interpolations inside text become text.
fn resolve_text(s: &str, root: &Value, at: &[String], depth: usize) -> Result<Value, ConfigError> {
    if depth > MAX_DEPTH {
        return Err(error(
            at,
            format!("`{s}`: the interpolations refer to each other in a cycle"),
        ));
    }
    let pieces = split(s).map_err(|m| error(at, format!("`{s}`: {m}")))?;
    if let [Piece::Expr(expr)] = pieces.as_slice() {
        return evaluate(expr, root, at, depth);
    }
    let mut out = String::new();
    for piece in pieces {
        match piece {
            Piece::Text(t) => out.push_str(t),
            Piece::Expr(expr) => match evaluate(expr, root, at, depth)? {
                Value::String(t) => out.push_str(&t),
                Value::Null => out.push_str("None"),
                other => out.push_str(&other.to_string()),
            },
        }
    }
    Ok(Value::String(out))
}

enum Piece<'a> {
    Text(&'a str),
    Expr(&'a str),
}

/// Splits text into literal parts and `${...}` expressions (braces inside an expression, as in
/// a `{}` default, are matched).
fn split(s: &str) -> Result<Vec<Piece<'_>>, String> {
    let mut pieces = Vec::new();
    let mut rest = s;
    while let Some(start) = rest.find("${") {
        if start > 0 {
            pieces.push(Piece::Text(&rest[..start]));
        }
        let body = &rest[start + 2..];
        let mut depth = 1usize;
        let end = body
            .char_indices()
            .find_map(|(i, c)| {
                match c {
                    '{' => depth += 1,
                    '}' => depth -= 1,
                    _ => {}
                }
                (depth == 0).then_some(i)
            })
            .ok_or("an interpolation `${` is not closed")?;
        pieces.push(Piece::Expr(body[..end].trim()));
        rest = &body[end + 1..];
    }
    if !rest.is_empty() {
        pieces.push(Piece::Text(rest));
    }
    Ok(pieces)
}

/// One expression: `oc.select:key[,default]` or a key.
fn evaluate(expr: &str, root: &Value, at: &[String], depth: usize) -> Result<Value, ConfigError> {
    if let Some(args) = expr.strip_prefix("oc.select:") {
        let (key, default) = match top_level_comma(args) {
            Some(i) => (args[..i].trim(), Some(args[i + 1..].trim())),
            None => (args.trim(), None),
        };
        // OmegaConf's select takes the default where the key is missing or still `???`.
        return match lookup(key, root, at) {
            Some((path, v)) if v.as_str() != Some("???") => follow(v, root, &path, depth),
            _ => Ok(default.map_or(Value::Null, parse_default)),
        };
    }
    if let Some((resolver, _)) = expr.split_once(':') {
        return Err(error(
            at,
            format!("`${{{expr}}}`: the resolver `{resolver}` is not supported (only oc.select)"),
        ));
    }
    match lookup(expr, root, at) {
        Some((_, v)) if v.as_str() == Some("???") => Err(error(
            at,
            format!("`${{{expr}}}` names a mandatory value (`???`) that is not set: set it"),
        )),
        Some((path, v)) => follow(v, root, &path, depth),
        None => Err(error(
            at,
            format!("`${{{expr}}}` names a key that does not exist"),
        )),
    }
}

/// A referenced value, with its own interpolations resolved.
fn follow(v: &Value, root: &Value, path: &[String], depth: usize) -> Result<Value, ConfigError> {
    match v {
        Value::String(s) if s.contains("${") => resolve_text(s, root, path, depth + 1),
        Value::Object(m) => {
            let mut out = Map::new();
            for (k, child) in m {
                let mut p = path.to_vec();
                p.push(k.clone());
                out.insert(k.clone(), follow(child, root, &p, depth + 1)?);
            }
            Ok(Value::Object(out))
        }
        other => Ok(other.clone()),
    }
}

fn top_level_comma(s: &str) -> Option<usize> {
    let mut depth = 0i32;
    let mut quoted = None;
    for (i, c) in s.char_indices() {
        match (c, quoted) {
            ('"' | '\'', None) => quoted = Some(c),
            (q, Some(open)) if q == open => quoted = None,
            ('{' | '[', None) => depth += 1,
            ('}' | ']', None) => depth -= 1,
            (',', None) if depth == 0 => return Some(i),
            _ => {}
        }
    }
    None
}

/// An `oc.select` default: a YAML scalar or flow collection (`false`, `16384`, `{}`, `null`,
/// `"text"`); OmegaConf's `None` and `True` / `False` as Python writes them.
fn parse_default(text: &str) -> Value {
    match text {
        "None" => Value::Null,
        "True" => Value::Bool(true),
        "False" => Value::Bool(false),
        _ => serde_yaml::from_str(text).unwrap_or_else(|_| Value::String(text.to_string())),
    }
}

/// The value `key` names, seen from the value at `at`, with its path: an absolute dotted key,
/// or a relative one (`.x` beside the holder, `..x` beside the holder's section).
fn lookup<'a>(key: &str, root: &'a Value, at: &[String]) -> Option<(Vec<String>, &'a Value)> {
    let dots = key.chars().take_while(|c| *c == '.').count();
    let mut path: Vec<String> = if dots == 0 {
        Vec::new()
    } else {
        // The holder's section, then one level up per extra dot.
        let up = dots;
        at[..at.len().checked_sub(up)?].to_vec()
    };
    let rest = &key[dots..];
    if !rest.is_empty() {
        path.extend(rest.split('.').map(str::to_string));
    }
    let mut node = root;
    for part in &path {
        node = node.as_object()?.get(part)?;
    }
    Some((path, node))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn resolved(mut v: Value) -> Value {
        resolve_interpolations(&mut v).unwrap();
        v
    }

    #[test]
    fn absolute_relative_and_select() {
        let v = resolved(json!({
            "a": {"x": 3, "y": "${a.x}", "z": "${.x}", "w": "${..b.q}"},
            "b": {"q": "${oc.select:a.missing,{}}", "r": "${oc.select:a.x,7}",
                  "s": "${oc.select:nope.nope, null}", "t": "${oc.select:a.y,False}"},
        }));
        assert_eq!(v["a"], json!({"x": 3, "y": 3, "z": 3, "w": {}}));
        assert_eq!(v["b"], json!({"q": {}, "r": 3, "s": null, "t": 3}));
    }

    #[test]
    fn text_with_interpolations_inside_becomes_text() {
        let v = resolved(json!({
            "trainer": {"p": "proj", "e": 2, "dir": "checkpoints/${trainer.p}/${trainer.e}"},
        }));
        assert_eq!(v["trainer"]["dir"], "checkpoints/proj/2");
    }

    #[test]
    fn a_quoted_default_keeps_its_commas_out_of_the_split() {
        let v = resolved(json!({"m": {"t": "${oc.select:x.path,\"~/models/a,b\"}"}}));
        assert_eq!(v["m"]["t"], "~/models/a,b");
    }

    #[test]
    fn select_of_a_mandatory_mark_takes_the_default_and_a_plain_reference_refuses() {
        let v = resolved(json!({"a": "???", "b": "${oc.select:a,7}"}));
        assert_eq!(v["b"], 7);
        let mut v = json!({"a": "???", "b": "${a}"});
        let e = resolve_interpolations(&mut v).unwrap_err().to_string();
        assert!(e.contains("mandatory"), "{e}");
    }

    #[test]
    fn targets_are_dropped_at_every_depth() {
        let v = resolved(json!({"_target_": "x", "a": {"_target_": "y", "b": [{"_target_": 1}]}}));
        assert_eq!(v, json!({"a": {"b": [{}]}}));
    }

    #[test]
    fn a_missing_key_and_a_cycle_name_the_holder() {
        let mut v = json!({"a": {"b": "${c.d}"}});
        let e = resolve_interpolations(&mut v).unwrap_err();
        assert!(
            matches!(&e, ConfigError::Key { key, .. } if key == "a.b"),
            "{e}"
        );
        let mut v = json!({"a": "${b}", "b": "${a}"});
        let e = resolve_interpolations(&mut v).unwrap_err().to_string();
        assert!(e.contains("cycle"), "{e}");
        let mut v = json!({"a": "${oc.env:HOME}"});
        let e = resolve_interpolations(&mut v).unwrap_err().to_string();
        assert!(e.contains("oc.env"), "{e}");
    }
}
