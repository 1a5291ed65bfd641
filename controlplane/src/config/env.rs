//! Environment snapshot and `OQP_SECTION__KEY=value` overrides.
//!
//! The loader never reads the process environment itself: [`Env`] is a snapshot taken once by
//! `main` ([`Env::from_process`]) or built by a test ([`Env::from_pairs`]). Overrides are applied
//! to the YAML value tree after the file is parsed and before anything is typed, so they go
//! through exactly the same checks as the file.
//!
//! Rules: the name after `OQP_` is lower-cased and split on `__`; numeric components index lists
//! (an index equal to the list's length appends an item); the value becomes a boolean
//! (`true`/`false`, any case), an integer or a decimal if it reads back identically, else a string.
//! `OQP_CONFIG` names the file and is not an override. Unlike the Python original, list items
//! can be overridden and a conflicting variable is reported instead of crashing.

use std::cmp::Ordering;
use std::collections::BTreeMap;
use std::fmt;

use serde_yaml::{Mapping, Number, Value};

use super::error::Problems;

/// The variable naming the config file.
pub const CONFIG_VAR: &str = "OQP_CONFIG";

const PREFIX: &str = "OQP_";

/// A snapshot of environment variables.
#[derive(Clone, Default)]
pub struct Env {
    vars: BTreeMap<String, String>,
}

/// One component of an override path.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Step {
    Key(String),
    Index(usize),
}

impl Env {
    /// An environment with no variables.
    pub fn empty() -> Self {
        Self::default()
    }

    /// The current process environment (variables that are not valid UTF-8 are skipped).
    pub fn from_process() -> Self {
        let vars = std::env::vars_os()
            .filter_map(|(name, value)| Some((name.into_string().ok()?, value.into_string().ok()?)))
            .collect();
        Self { vars }
    }

    /// An environment with exactly these variables.
    pub fn from_pairs<I, K, V>(pairs: I) -> Self
    where
        I: IntoIterator<Item = (K, V)>,
        K: Into<String>,
        V: Into<String>,
    {
        let vars = pairs
            .into_iter()
            .map(|(name, value)| (name.into(), value.into()))
            .collect();
        Self { vars }
    }

    /// The value of a variable.
    pub fn get(&self, name: &str) -> Option<&str> {
        self.vars.get(name).map(String::as_str)
    }
}

impl fmt::Debug for Env {
    // Values may be credentials (key_env targets, OLLAMA_API_KEY): print names only.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Env")
            .field("names", &self.vars.keys().collect::<Vec<_>>())
            .finish()
    }
}

/// Applies every `OQP_*` override in `env` onto `root` (a mapping), recording problems.
/// Variables whose first component is not one of `sections` are reported and skipped.
/// Variables the oqp programs read for themselves (logging, the data
/// plane's command line, test modes): never config overrides.
const PROCESS_VARS: [&str; 6] = [
    "OQP_LOG",
    "OQP_LOG_FORMAT",
    "OQP_NODE",
    "OQP_NODE_TOKEN",
    "OQP_CONTROL_PLANE",
    "OQP_SOAK",
];

pub(crate) fn apply_overrides(
    root: &mut Value,
    env: &Env,
    sections: &[&str],
    problems: &mut Problems,
) {
    if !root.is_mapping() {
        // The document itself is malformed (reported by the schema step); nothing to set into.
        return;
    }
    let mut overrides = Vec::new();
    for (name, value) in &env.vars {
        let Some(rest) = name.strip_prefix(PREFIX) else {
            continue;
        };
        // The programs' own settings share the prefix but are not config
        // overrides.
        if name == CONFIG_VAR || PROCESS_VARS.contains(&name.as_str()) {
            continue;
        }
        let parts: Vec<String> = rest
            .to_lowercase()
            .split("__")
            .map(str::to_string)
            .collect();
        if parts.iter().any(String::is_empty) {
            problems.error(format!(
                "{name}: empty component in the override path (expected OQP_SECTION__KEY, \
                 separated by double underscores)"
            ));
            continue;
        }
        if !sections.contains(&parts[0].as_str()) {
            problems.warn(format!(
                "environment variable {name} does not name a config section (ignored)"
            ));
            continue;
        }
        let steps: Vec<Step> = parts.into_iter().map(Step::parse).collect();
        overrides.push((name, steps, value));
    }
    // Apply in path order, numeric components numerically, so that `__2__` comes before `__10__`
    // and list items are appended in index order.
    overrides.sort_by(|a, b| a.1.cmp(&b.1).then_with(|| a.0.cmp(b.0)));
    for (name, steps, value) in overrides {
        if let Err(reason) = set_path(root, &steps, coerce(value), name) {
            problems.error(format!("{name}: {reason}"));
        }
    }
}

/// Turns an override's text into a YAML scalar by its shape.
pub(crate) fn coerce(text: &str) -> Value {
    if text.eq_ignore_ascii_case("true") {
        return Value::Bool(true);
    }
    if text.eq_ignore_ascii_case("false") {
        return Value::Bool(false);
    }
    let numeric = !text.is_empty()
        && text
            .strip_prefix('-')
            .unwrap_or(text)
            .bytes()
            .all(|b| b.is_ascii_digit() || b == b'.');
    if numeric {
        // Only when the number prints back identically, so that text such as "007" or "1.50"
        // reaching a string field (a token, a name) arrives unchanged.
        if let Ok(integer) = text.parse::<i64>()
            && integer.to_string() == text
        {
            return Value::Number(Number::from(integer));
        }
        if let Ok(integer) = text.parse::<u64>()
            && integer.to_string() == text
        {
            return Value::Number(Number::from(integer));
        }
        if let Ok(float) = text.parse::<f64>()
            && text.contains('.')
            && float.is_finite()
            && float.to_string() == text
        {
            return Value::Number(Number::from(float));
        }
    }
    Value::String(text.to_string())
}

impl Step {
    fn parse(part: String) -> Self {
        match part.parse::<usize>() {
            Ok(index) if part.bytes().all(|b| b.is_ascii_digit()) => Step::Index(index),
            _ => Step::Key(part),
        }
    }
}

impl Ord for Step {
    fn cmp(&self, other: &Self) -> Ordering {
        match (self, other) {
            (Step::Index(a), Step::Index(b)) => a.cmp(b),
            (Step::Key(a), Step::Key(b)) => a.cmp(b),
            (Step::Index(_), Step::Key(_)) => Ordering::Less,
            (Step::Key(_), Step::Index(_)) => Ordering::Greater,
        }
    }
}

impl PartialOrd for Step {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

/// Sets `value` at `steps` under `root`, creating mappings and lists on the way.
fn set_path(root: &mut Value, steps: &[Step], value: Value, name: &str) -> Result<(), String> {
    let mut node = root;
    let mut walked = String::new();
    for (position, step) in steps.iter().enumerate() {
        let last = position + 1 == steps.len();
        if node.is_null() {
            *node = match step {
                Step::Index(_) => Value::Sequence(Vec::new()),
                Step::Key(_) => Value::Mapping(Mapping::new()),
            };
        }
        let here = join(&walked, step);
        node = match (node, step) {
            (Value::Mapping(map), step) => {
                let key = Value::String(step.text());
                if last {
                    return replace(map.entry(key).or_insert(Value::Null), value, &here, name);
                }
                map.entry(key).or_insert(Value::Null)
            }
            (Value::Sequence(items), Step::Index(index)) => {
                let index = *index;
                if index > items.len() {
                    return Err(format!(
                        "index {index} is past the end of {walked} ({} item(s)); \
                         the next new item is index {}",
                        items.len(),
                        items.len()
                    ));
                }
                if index == items.len() {
                    items.push(Value::Null);
                }
                if last {
                    return replace(&mut items[index], value, &here, name);
                }
                &mut items[index]
            }
            (Value::Sequence(_), Step::Key(key)) => {
                return Err(format!(
                    "{walked} is a list, so '{key}' must be a numeric index (e.g. …__0__{})",
                    key.to_uppercase()
                ));
            }
            (other, _) => {
                return Err(format!(
                    "cannot set {here}: {walked} is {}, not a section (is another variable \
                     setting {walked} itself?)",
                    describe(other)
                ));
            }
        };
        walked = here;
    }
    Ok(())
}

/// Replaces a leaf; a whole section or list is never replaced by one scalar.
fn replace(slot: &mut Value, value: Value, path: &str, name: &str) -> Result<(), String> {
    let entry = match slot {
        Value::Mapping(_) => "<KEY>",
        Value::Sequence(_) => "<INDEX>",
        _ => {
            *slot = value;
            return Ok(());
        }
    };
    Err(format!(
        "cannot replace {path} ({}) with a single value; set its entries with {name}__{entry}",
        describe(slot)
    ))
}

fn join(walked: &str, step: &Step) -> String {
    match step {
        Step::Index(index) => format!("{walked}[{index}]"),
        Step::Key(key) if walked.is_empty() => key.clone(),
        Step::Key(key) => format!("{walked}.{key}"),
    }
}

impl Step {
    fn text(&self) -> String {
        match self {
            Step::Key(key) => key.clone(),
            Step::Index(index) => index.to_string(),
        }
    }
}

fn describe(value: &Value) -> &'static str {
    match value {
        Value::Null => "empty",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Sequence(_) => "a list",
        Value::Mapping(_) => "a section",
        Value::Tagged(_) => "a tagged value",
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    const SECTIONS: &[&str] = &["proxy", "ollama", "auth", "control_plane", "nodes"];

    fn apply(yaml: &str, vars: &[(&str, &str)]) -> (Value, Problems) {
        let mut root: Value = serde_yaml::from_str(yaml).unwrap();
        let mut problems = Problems::default();
        apply_overrides(
            &mut root,
            &Env::from_pairs(vars.iter().copied()),
            SECTIONS,
            &mut problems,
        );
        (root, problems)
    }

    fn at<'a>(root: &'a Value, path: &str) -> &'a Value {
        path.split('.')
            .fold(root, |node, part| match part.parse::<usize>() {
                Ok(index) => &node[index],
                Err(_) => &node[part],
            })
    }

    #[test]
    fn sets_nested_keys_with_coercion() {
        let (root, problems) = apply(
            "proxy: {port: 1}",
            &[
                ("OQP_PROXY__PORT", "8080"),
                ("OQP_PROXY__HOST", "0.0.0.0"),
                ("OQP_AUTH__ENABLED", "TRUE"),
            ],
        );
        assert!(problems.is_empty(), "{problems:?}");
        assert_eq!(at(&root, "proxy.port"), &Value::Number(8080.into()));
        assert_eq!(at(&root, "proxy.host"), &Value::String("0.0.0.0".into()));
        assert_eq!(at(&root, "auth.enabled"), &Value::Bool(true));
    }

    #[test]
    fn list_items_are_indexed_and_appended_in_numeric_order() {
        let vars: Vec<(String, String)> = (0..12)
            .map(|i| (format!("OQP_OLLAMA__HOSTS__{i}__NAME"), format!("h{i}")))
            .collect();
        let mut root: Value = serde_yaml::from_str("ollama: {hosts: [{name: a, url: x}]}").unwrap();
        let mut problems = Problems::default();
        apply_overrides(&mut root, &Env::from_pairs(vars), SECTIONS, &mut problems);
        assert!(problems.is_empty(), "{problems:?}");
        assert_eq!(at(&root, "ollama.hosts.0.url"), &Value::String("x".into()));
        assert_eq!(
            at(&root, "ollama.hosts.11.name"),
            &Value::String("h11".into())
        );
        assert_eq!(
            root["ollama"]["hosts"].as_sequence().map(Vec::len),
            Some(12)
        );
    }

    #[test]
    fn creates_lists_from_nothing() {
        let (root, problems) = apply("{}", &[("OQP_OLLAMA__HOSTS__0__URL", "http://a:1")]);
        assert!(problems.is_empty());
        assert_eq!(
            at(&root, "ollama.hosts.0.url"),
            &Value::String("http://a:1".into())
        );
    }

    #[test]
    fn index_past_the_end_names_the_variable() {
        let (_, problems) = apply("{}", &[("OQP_AUTH__KEYS__2__KEY_ENV", "X")]);
        let errors = problems.errors().join("\n");
        assert!(
            errors.starts_with("OQP_AUTH__KEYS__2__KEY_ENV: index 2 is past the end"),
            "{errors}"
        );
    }

    #[test]
    fn conflicts_are_errors_not_crashes() {
        let (_, problems) = apply("{}", &[("OQP_PROXY", "1"), ("OQP_PROXY__PORT", "2")]);
        let errors = problems.errors().join("\n");
        assert!(
            errors.contains("OQP_PROXY__PORT: cannot set proxy.port: proxy is a number"),
            "{errors}"
        );

        let (_, problems) = apply("proxy: {port: 1}", &[("OQP_PROXY", "1")]);
        assert!(problems.errors()[0].starts_with("OQP_PROXY: cannot replace proxy (a section)"));

        let (_, problems) = apply("ollama: {hosts: []}", &[("OQP_OLLAMA__HOSTS__URL", "x")]);
        assert!(problems.errors()[0].contains("must be a numeric index"));

        let (_, problems) = apply("{}", &[("OQP_PROXY____PORT", "1")]);
        assert!(problems.errors()[0].contains("empty component"));
    }

    #[test]
    fn config_var_and_foreign_vars() {
        let (root, problems) = apply(
            "{}",
            &[
                ("OQP_CONFIG", "/etc/oqp.yml"),
                ("OQP_NODE_NAME", "a"),
                ("HOME", "/root"),
            ],
        );
        assert_eq!(root, serde_yaml::from_str::<Value>("{}").unwrap());
        assert!(problems.errors().is_empty());
        assert_eq!(problems.warnings().len(), 1);
        assert!(problems.warnings()[0].contains("OQP_NODE_NAME"));
    }

    #[test]
    fn coercion_keeps_odd_text_as_text() {
        assert_eq!(coerce("007"), Value::String("007".into()));
        assert_eq!(coerce("1.50"), Value::String("1.50".into()));
        assert_eq!(coerce("1.5"), Value::Number(Number::from(1.5)));
        assert_eq!(coerce("-1"), Value::Number(Number::from(-1)));
        assert_eq!(coerce("127.0.0.1"), Value::String("127.0.0.1".into()));
        assert_eq!(coerce(""), Value::String(String::new()));
        assert_eq!(coerce("False"), Value::Bool(false));
    }

    #[test]
    fn debug_shows_names_only() {
        let env = Env::from_pairs([("OLLAMA_API_KEY", "sk-secret")]);
        assert_eq!(format!("{env:?}"), "Env { names: [\"OLLAMA_API_KEY\"] }");
    }

    proptest! {
        #[test]
        fn integers_round_trip(n in any::<i64>()) {
            prop_assert_eq!(coerce(&n.to_string()), Value::Number(Number::from(n)));
        }

        #[test]
        fn large_unsigned_round_trip(n in any::<u64>()) {
            prop_assert_eq!(coerce(&n.to_string()), Value::Number(Number::from(n)));
        }

        #[test]
        fn booleans_round_trip(b in any::<bool>(), upper in any::<bool>()) {
            let text = if upper { b.to_string().to_uppercase() } else { b.to_string() };
            prop_assert_eq!(coerce(&text), Value::Bool(b));
        }

        #[test]
        fn string_fields_read_coerced_text_back_unchanged(text in "[0-9a-z.-]{0,12}") {
            let shown: crate::config::scalar::Text = serde_yaml::from_value(coerce(&text)).unwrap();
            prop_assert_eq!(shown.0, text);
        }
    }
}
