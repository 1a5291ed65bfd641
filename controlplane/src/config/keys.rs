//! Resolving credentials: `key` / `key_env` / `key_file` (and the `node_token*` trio) into
//! [`Secret`]s, and building the `auth.keys[]` and cloud key pools.
//!
//! Every message names the entry (its client_id, host name or section) and the *source*
//! (variable name, file path) but never the value.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::time::{Duration, SystemTime};

use super::enums::{Scope, Tier, Vocabulary, parse_word};
use super::env::Env;
use super::error::Problems;
use super::scalar::{Int, Text};
use super::schema::{
    RawBudget, RawCapture, RawClaimsToPolicy, RawCloudKey, RawJwt, RawKey, RawMinuteLimit, RawUsers,
};
use super::secret::Secret;
use super::types::{
    Budget, BudgetWindow, ClaimPolicy, ClaimsToPolicy, CloudKey, JwksSource, JwtConfig, KeyConfig,
    MinuteLimit, UserSource, UsersConfig,
};

/// The three ways of giving one credential, with the field names of this entry.
pub(crate) struct KeySource<'a> {
    /// Field names, e.g. `["key", "key_env", "key_file"]`.
    pub fields: [&'a str; 3],
    pub literal: Option<&'a Text>,
    pub env_var: Option<&'a Text>,
    pub file: Option<&'a Text>,
}

/// Whether an entry must give a source or may give none.
#[derive(Clone, Copy, PartialEq)]
pub(crate) enum Required {
    ExactlyOne,
    AtMostOne,
}

impl<'a> KeySource<'a> {
    pub(crate) fn key(
        literal: Option<&'a Text>,
        env_var: Option<&'a Text>,
        file: Option<&'a Text>,
    ) -> Self {
        Self {
            fields: ["key", "key_env", "key_file"],
            literal,
            env_var,
            file,
        }
    }

    /// Resolves the source. `subject` starts every message, e.g.
    /// `auth.keys[] entry for client_id='x'`. Records an error and returns `Err` on failure.
    pub(crate) fn resolve(
        &self,
        subject: &str,
        required: Required,
        env: &Env,
        problems: &mut Problems,
    ) -> Result<Option<Secret>, ()> {
        let [literal_field, env_field, file_field] = self.fields;
        let given: Vec<&str> = [
            (literal_field, self.literal.is_some()),
            (env_field, self.env_var.is_some()),
            (file_field, self.file.is_some()),
        ]
        .into_iter()
        .filter_map(|(field, set)| set.then_some(field))
        .collect();
        let choice = match required {
            Required::ExactlyOne => "exactly one",
            Required::AtMostOne => "at most one",
        };
        if given.len() > 1 {
            problems.error(format!(
                "{subject} sets {} — set {choice} of {literal_field}, {env_field} or {file_field}",
                given.join(", ")
            ));
            return Err(());
        }
        let (value, origin) = if let Some(Text(value)) = self.literal {
            (value.clone(), literal_field.to_string())
        } else if let Some(Text(name)) = self.env_var {
            let Some(value) = env.get(name) else {
                problems.error(format!(
                    "{subject} names {env_field}='{name}', which is not set in the environment"
                ));
                return Err(());
            };
            (value.to_string(), format!("{env_field}='{name}'"))
        } else if let Some(Text(path)) = self.file {
            match std::fs::read_to_string(path) {
                // Trailing newlines from `echo secret > file` would make the key never match.
                Ok(content) => (
                    content.trim_end().to_string(),
                    format!("{file_field}='{path}'"),
                ),
                Err(error) => {
                    problems.error(format!(
                        "{subject} names {file_field}='{path}', which cannot be read: {error}"
                    ));
                    return Err(());
                }
            }
        } else {
            if required == Required::ExactlyOne {
                problems.error(format!(
                    "{subject} has no key: set exactly one of {literal_field}, {env_field} or {file_field}"
                ));
                return Err(());
            }
            return Ok(None);
        };
        if value.trim().is_empty() {
            problems.error(format!(
                "{subject} resolved to an empty key from {origin}. An empty credential would \
                 authenticate no one and is never intentional"
            ));
            return Err(());
        }
        if let Some(Text(path)) = self.file {
            warn_if_shared(Path::new(path), subject, problems);
        }
        Ok(Some(Secret::new(value)))
    }
}

/// Warns when a secret file is accessible to others or writable by its group. Reading by
/// the group is how a service's user is given its keys (the Debian package's `root:oqp`,
/// a container's gid with `chmod 640`), so that alone is not warned about.
#[cfg(unix)]
fn warn_if_shared(path: &Path, subject: &str, problems: &mut Problems) {
    use std::os::unix::fs::PermissionsExt;
    if let Ok(metadata) = std::fs::metadata(path) {
        let mode = metadata.permissions().mode() & 0o777;
        if mode & 0o027 != 0 {
            problems.warn(format!(
                "{subject}: key file '{}' is accessible by others or writable by its group \
                 (mode {mode:04o}); restrict it with chmod 600, or 640 for a service's group",
                path.display()
            ));
        }
    }
}

#[cfg(not(unix))]
fn warn_if_shared(_: &Path, _: &str, _: &mut Problems) {}

/// Resolves `auth.keys[]`. `None` if any entry failed. `proxy_max` is `proxy.max_concurrent`
/// when that section resolved.
pub(crate) fn resolve_auth_keys(
    raw: &[RawKey],
    proxy_max: Option<u32>,
    env: &Env,
    problems: &mut Problems,
) -> Option<Vec<KeyConfig>> {
    let before = problems.error_count();
    let keys: Vec<KeyConfig> = raw
        .iter()
        .enumerate()
        .filter_map(|(index, key)| resolve_key(index, key, proxy_max, env, problems))
        .collect();
    if problems.error_count() != before {
        return None;
    }
    let mut seen_ids: BTreeMap<&str, usize> = BTreeMap::new();
    let mut seen_keys: HashMap<[u8; 32], &str> = HashMap::new();
    let mut seen_subjects: HashMap<&str, &str> = HashMap::new();
    for (index, key) in keys.iter().enumerate() {
        if let Some(subject) = &key.tls_subject
            && let Some(other) = seen_subjects.insert(subject, &key.client_id)
        {
            problems.error(format!(
                "auth.keys: client_id='{other}' and client_id='{}' name the same tls_subject \
                 '{subject}'; a certificate identifies one client",
                key.client_id
            ));
        }
        if let Some(first) = seen_ids.insert(&key.client_id, index) {
            problems.error(format!(
                "auth.keys: duplicate client_id '{}' (entries {first} and {index}); every client_id \
                 must be unique",
                key.client_id
            ));
        }
        let Some(secret) = &key.key else {
            continue;
        };
        if let Some(other) = seen_keys.insert(secret.sha256(), &key.client_id) {
            problems.error(format!(
                "auth.keys: client_id='{other}' and client_id='{}' resolve to the same key; every \
                 client needs its own key",
                key.client_id
            ));
        }
    }
    (problems.error_count() == before).then_some(keys)
}

fn resolve_key(
    index: usize,
    raw: &RawKey,
    proxy_max: Option<u32>,
    env: &Env,
    problems: &mut Problems,
) -> Option<KeyConfig> {
    let client_id = raw.client_id.0.trim().to_string();
    if client_id.is_empty() {
        problems.error(format!("auth.keys[{index}].client_id must not be empty"));
        return None;
    }
    let before = problems.error_count();
    if client_id.contains('/') {
        problems.error(format!(
            "auth.keys[{index}].client_id '{client_id}' must not contain '/' (it separates an app \
             key's users: <client_id>/<user>)"
        ));
        return None;
    }
    let at = format!("auth.keys[client_id={client_id}]");
    let subject = format!("auth.keys[] entry for client_id='{client_id}'");
    // With `jwt`, each user's token is the credential, and the entry has no key.
    let jwt = raw
        .jwt
        .as_ref()
        .and_then(|jwt| resolve_jwt(jwt, &format!("{at}.jwt"), true, problems));
    // With `tls_subject`, a verified client certificate is the credential.
    let tls_subject = raw
        .tls_subject
        .as_ref()
        .map(|text| text.0.trim().to_owned());
    if let Some(subject) = &tls_subject
        && (subject.is_empty() || subject.len() > 256 || subject.chars().any(char::is_control))
    {
        problems.error(format!(
            "{at}.tls_subject must be a certificate's Common Name (1-256 characters)"
        ));
    }
    if raw.jwt.is_some() && tls_subject.is_some() {
        problems.error(format!("{at}: set jwt or tls_subject, not both"));
    }
    let required = if raw.jwt.is_some() || tls_subject.is_some() {
        Required::AtMostOne
    } else {
        Required::ExactlyOne
    };
    let key = KeySource::key(
        raw.key.as_ref(),
        raw.key_env.as_ref(),
        raw.key_file.as_ref(),
    )
    .resolve(&subject, required, env, problems)
    .ok()
    .flatten();
    if tls_subject.is_some() && key.is_some() {
        problems.error(format!(
            "{at}: set tls_subject or a key (key, key_env, key_file), not both"
        ));
    }
    if raw.jwt.is_some() && key.is_some() {
        problems.error(format!(
            "{at}: set jwt or a key (key, key_env, key_file), not both; an app that \
             authenticates with its key and names each user with a token sets users.jwt"
        ));
    }

    let explicit_scope = word::<Scope>(raw.scope.as_ref(), &format!("{at}.scope"), problems);
    let management = raw.management.is_some_and(|flag| flag.0);
    let scope = match (management, explicit_scope) {
        (true, Some(scope)) if scope != Scope::Management => {
            problems.error(format!(
                "{at}: management: true and scope: {scope} contradict each other; remove the \
                 deprecated management: true or set scope: management"
            ));
            Scope::Management
        }
        (true, _) => {
            problems.warn(format!(
                "config.deprecated key={at}.management — superseded by `scope: management`; \
                 replace management: true with scope: management"
            ));
            Scope::Management
        }
        (false, scope) => scope.unwrap_or(Scope::Inference),
    };

    let max_priority = word::<Tier>(
        raw.max_priority.as_ref(),
        &format!("{at}.max_priority"),
        problems,
    )
    .unwrap_or(Tier::Normal);
    let default_priority = match word::<Tier>(
        raw.default_priority.as_ref(),
        &format!("{at}.default_priority"),
        problems,
    ) {
        Some(tier) if tier > max_priority => {
            problems.warn(format!(
                    "{at}.default_priority {tier} is above max_priority {max_priority}; using {max_priority}"
                ));
            max_priority
        }
        Some(tier) => tier,
        None => max_priority.min(Tier::Normal),
    };

    let max_concurrent = raw.max_concurrent.map_or(0, |value| value.0);
    let max_concurrent = match u32::try_from(max_concurrent) {
        Ok(value) => value,
        Err(_) => {
            problems.error(format!(
                "{at}.max_concurrent must be a non-negative integer, got {max_concurrent}"
            ));
            0
        }
    };
    if let Some(proxy_max) = proxy_max
        && max_concurrent > proxy_max
    {
        problems.error(format!(
            "{at}.max_concurrent ({max_concurrent}) exceeds proxy.max_concurrent ({proxy_max}). \
             Set max_concurrent <= {proxy_max} or increase proxy.max_concurrent."
        ));
    }

    let weight = raw.weight.map_or(1.0, |value| value.0);
    if !(weight.is_finite() && weight > 0.0) {
        problems.error(format!("{at}.weight must be a number > 0, got {weight}"));
    }
    let max_queued = raw.max_queued.map_or(0, |value| value.0);
    let max_queued = u32::try_from(max_queued).unwrap_or_else(|_| {
        problems.error(format!(
            "{at}.max_queued must be a non-negative integer (0 = unlimited), got {max_queued}"
        ));
        0
    });
    let expires = match raw.expires.as_ref().map(|text| text.0.trim()) {
        None => None,
        Some(text) if text.eq_ignore_ascii_case("none") || text.eq_ignore_ascii_case("never") => {
            None
        }
        Some(text) => match parse_timestamp(text) {
            Ok(time) => {
                if time <= SystemTime::now() {
                    problems.warn(format!(
                        "{at}.expires {text} is in the past; this key will not authenticate"
                    ));
                }
                Some(time)
            }
            Err(()) => {
                problems.error(format!(
                    "{at}.expires: '{text}' is not an RFC 3339 time (e.g. 2026-12-31T23:59:59Z) or none"
                ));
                None
            }
        },
    };

    let budget = raw
        .budget
        .as_ref()
        .and_then(|budget| resolve_budget(budget, &at, problems));
    let models = resolve_models(raw.models.as_deref(), &at, problems);
    let users = match (&raw.users, jwt) {
        (Some(users), jwt) => resolve_users(users, &at, jwt, problems),
        // A token-keyed entry's users have no caps or budget of their own.
        (None, Some(jwt)) => Some(UsersConfig {
            source: UserSource::Jwt(jwt),
            max_concurrent: 0,
            max_queued: 0,
            budget: None,
            session_header: None,
            rate_limit: None,
        }),
        (None, None) => None,
    };
    if let Some(users) = &users {
        let at = if raw.jwt.is_some() {
            format!("{at}.jwt")
        } else {
            format!("{at}.users.jwt")
        };
        check_claim_budgets(users, &at, problems);
    }
    let rate_limit = raw
        .rate_limit
        .as_ref()
        .and_then(|limit| resolve_minute_limit(limit, &format!("{at}.rate_limit"), problems));
    let capture = raw
        .capture
        .as_ref()
        .and_then(|capture| resolve_capture(capture, &format!("{at}.capture"), problems));

    if problems.error_count() != before {
        return None;
    }
    if key.is_none() && raw.jwt.is_none() && tls_subject.is_none() {
        return None;
    }
    Some(KeyConfig {
        client_id,
        key,
        tls_subject,
        description: raw.description.as_ref().map(|text| text.0.clone()),
        scope,
        max_priority,
        default_priority,
        max_concurrent,
        weight,
        max_queued,
        expires,
        budget,
        models,
        users,
        rate_limit,
        capture,
    })
}

/// The most `capture.max_bytes` may be: each side of a request log line stays below it.
pub const MAX_CAPTURE_BYTES: i64 = 1024 * 1024;

/// A key's `capture` block at `at`: `max_bytes`, from 1 to [`MAX_CAPTURE_BYTES`].
fn resolve_capture(raw: &RawCapture, at: &str, problems: &mut Problems) -> Option<u32> {
    let Some(value) = raw.max_bytes.as_ref().map(|value| value.0) else {
        problems.error(format!(
            "{at} sets no max_bytes; set how many bytes of each request and answer the \
             request log keeps (1 to {MAX_CAPTURE_BYTES}), or remove it"
        ));
        return None;
    };
    match u32::try_from(value) {
        Ok(bytes) if (1..=MAX_CAPTURE_BYTES).contains(&value) => Some(bytes),
        _ => {
            problems.error(format!(
                "{at}.max_bytes must be an integer from 1 to {MAX_CAPTURE_BYTES}, got {value}"
            ));
            None
        }
    }
}

/// `auth.keys[].models` (and a store key's `--models`): model-name globs, `*` and `?`.
pub fn resolve_models(raw: Option<&[Text]>, at: &str, problems: &mut Problems) -> Vec<String> {
    let mut models = Vec::new();
    for (index, pattern) in raw.unwrap_or_default().iter().enumerate() {
        match check_model_pattern(&pattern.0) {
            Ok(pattern) => models.push(pattern),
            Err(why) => problems.error(format!("{at}.models[{index}] {why}")),
        }
    }
    if raw.is_some_and(<[Text]>::is_empty) {
        problems.error(format!(
            "{at}.models is empty: the key could use no model; list some, or remove models to \
             allow every model"
        ));
    }
    models
}

/// A model pattern as written, trimmed, or why it is not one.
pub fn check_model_pattern(pattern: &str) -> Result<String, String> {
    let pattern = pattern.trim();
    if pattern.is_empty() {
        return Err("must not be empty".to_owned());
    }
    if pattern.len() > 256 || pattern.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err(format!(
            "'{pattern}' is not a model name pattern (at most 256 characters, no spaces)"
        ));
    }
    Ok(pattern.to_owned())
}

/// `auth.keys[].users`. `token` is the key's own `jwt` (each user's token is then the
/// credential, and `users` carries only the caps and budget of each user).
fn resolve_users(
    raw: &RawUsers,
    at: &str,
    token: Option<JwtConfig>,
    problems: &mut Problems,
) -> Option<UsersConfig> {
    let at = format!("{at}.users");
    let text = |value: &Option<Text>| {
        value
            .as_ref()
            .map(|text| text.0.trim().to_owned())
            .filter(|text| !text.is_empty())
    };
    let header_ok = |name: &str, key: &str, problems: &mut Problems| {
        if http::HeaderName::from_bytes(name.as_bytes()).is_err() {
            problems.error(format!("{at}.{key} '{name}' is not a header name"));
        }
    };
    let given = [
        ("header", raw.header.is_some()),
        ("body_field", raw.body_field.is_some()),
        ("jwt", raw.jwt.is_some()),
    ]
    .into_iter()
    .filter_map(|(key, set)| set.then_some(key))
    .collect::<Vec<_>>();
    if let Some(token) = token {
        if !given.is_empty() {
            problems.error(format!(
                "{at}: the key's own jwt names each user; remove users.{}",
                given.join(", users.")
            ));
            return None;
        }
        return resolve_user_limits(raw, &at, UserSource::Jwt(token), problems);
    }
    if let Some(jwt) = &raw.jwt {
        if given.len() > 1 {
            problems.error(format!(
                "{at}: set one of header, body_field or jwt, not {}",
                given.join(" and ")
            ));
            return None;
        }
        let jwt = resolve_jwt(jwt, &format!("{at}.jwt"), false, problems)?;
        return resolve_user_limits(raw, &at, UserSource::Jwt(jwt), problems);
    }
    let source = match (text(&raw.header), text(&raw.body_field)) {
        (Some(header), None) => {
            header_ok(&header, "header", problems);
            UserSource::Header(header)
        }
        (None, Some(field)) => {
            if field.split('.').any(str::is_empty) {
                problems.error(format!(
                    "{at}.body_field '{field}' is not a path of keys (e.g. user, metadata.user_id)"
                ));
            }
            UserSource::BodyField(field)
        }
        (Some(_), Some(_)) => {
            problems.error(format!("{at}: set header or body_field, not both"));
            return None;
        }
        (None, None) => {
            problems.error(format!(
                "{at}: set header (e.g. X-OpenWebUI-User-Id), body_field (e.g. user) or jwt to \
                 say where the app names its user"
            ));
            return None;
        }
    };
    resolve_user_limits(raw, &at, source, problems)
}

/// The caps, budget and session header of `auth.keys[].users`, with the user's `source`.
fn resolve_user_limits(
    raw: &RawUsers,
    at: &str,
    source: UserSource,
    problems: &mut Problems,
) -> Option<UsersConfig> {
    let text = |value: &Option<Text>| {
        value
            .as_ref()
            .map(|text| text.0.trim().to_owned())
            .filter(|text| !text.is_empty())
    };
    let count = |value: &Option<Int>, key: &str, problems: &mut Problems| {
        let value = value.as_ref().map_or(0, |value| value.0);
        u32::try_from(value).unwrap_or_else(|_| {
            problems.error(format!(
                "{at}.{key} must be a non-negative integer (0 = unlimited), got {value}"
            ));
            0
        })
    };
    let max_concurrent = count(&raw.max_concurrent, "max_concurrent", problems);
    let max_queued = count(&raw.max_queued, "max_queued", problems);
    let budget = raw
        .budget
        .as_ref()
        .and_then(|budget| resolve_budget(budget, at, problems));
    let session_header = text(&raw.session_header);
    if let Some(name) = &session_header
        && http::HeaderName::from_bytes(name.as_bytes()).is_err()
    {
        problems.error(format!("{at}.session_header '{name}' is not a header name"));
    }
    let rate_limit = raw
        .rate_limit
        .as_ref()
        .and_then(|limit| resolve_minute_limit(limit, &format!("{at}.rate_limit"), problems));
    Some(UsersConfig {
        source,
        max_concurrent,
        max_queued,
        budget,
        session_header,
        rate_limit,
    })
}

/// A `rate_limit` block at `at` (named in every message): `requests_per_minute` and/or
/// `tokens_per_minute`, each a non-negative integer (0 = no limit of that kind, which lets a
/// key opt out of `auth.default_rate_limit`).
pub(crate) fn resolve_minute_limit(
    raw: &RawMinuteLimit,
    at: &str,
    problems: &mut Problems,
) -> Option<MinuteLimit> {
    if raw.requests_per_minute.is_none() && raw.tokens_per_minute.is_none() {
        problems.error(format!(
            "{at} sets neither requests_per_minute nor tokens_per_minute; set one or both \
             (0 = no limit of that kind), or remove it"
        ));
        return None;
    }
    let before = problems.error_count();
    let requests_per_minute = match raw.requests_per_minute.as_ref().map(|value| value.0) {
        None => 0,
        Some(value) => u32::try_from(value)
            .ok()
            .filter(|value| *value <= 1_000_000)
            .unwrap_or_else(|| {
                problems.error(format!(
                    "{at}.requests_per_minute must be an integer from 0 (no limit) to 1000000, \
                     got {value}"
                ));
                0
            }),
    };
    let tokens_per_minute = match raw.tokens_per_minute.as_ref().map(|value| value.0) {
        None => 0,
        Some(value) => u64::try_from(value)
            .ok()
            .filter(|value| *value <= 1_000_000_000_000)
            .unwrap_or_else(|| {
                problems.error(format!(
                    "{at}.tokens_per_minute must be an integer from 0 (no limit) to \
                     1000000000000, got {value}"
                ));
                0
            }),
    };
    (problems.error_count() == before).then_some(MinuteLimit {
        requests_per_minute,
        tokens_per_minute,
    })
}

/// The algorithms a `jwt` accepts unless it lists its own.
const DEFAULT_JWT_ALGORITHMS: [&str; 3] = ["RS256", "ES256", "EdDSA"];

/// The default `jwt.refresh_min_interval`.
const DEFAULT_JWKS_MIN_INTERVAL: Duration = Duration::from_secs(60);

/// `auth.keys[].jwt` (`credential`: the token is the entry's credential, and comes in
/// `Authorization` unless `header` says otherwise) and `auth.keys[].users.jwt` (the token
/// comes beside the app's key, in a header that must be named).
fn resolve_jwt(
    raw: &RawJwt,
    at: &str,
    credential: bool,
    problems: &mut Problems,
) -> Option<JwtConfig> {
    let before = problems.error_count();
    let text = |value: &Option<Text>| {
        value
            .as_ref()
            .map(|text| text.0.trim().to_owned())
            .filter(|text| !text.is_empty())
    };
    let list = |value: &Option<Vec<Text>>| -> Vec<String> {
        value
            .iter()
            .flatten()
            .map(|text| text.0.trim().to_owned())
            .filter(|text| !text.is_empty())
            .collect()
    };
    let issuer = text(&raw.issuer).unwrap_or_else(|| {
        problems.error(format!(
            "{at}.issuer is required: the iss of the tokens (e.g. https://login.example.com/realms/main)"
        ));
        String::new()
    });
    let audiences = list(&raw.audiences);
    if audiences.is_empty() {
        problems.error(format!(
            "{at}.audiences is required: the aud values a token may carry (the client id the \
             identity provider issued the tokens for)"
        ));
    }
    let jwks = match (text(&raw.jwks_url), text(&raw.jwks_file)) {
        (Some(url), None) => {
            let scheme = url
                .split_once("://")
                .map(|(scheme, _)| scheme.to_ascii_lowercase());
            if !matches!(scheme.as_deref(), Some("http" | "https"))
                || url.parse::<http::Uri>().is_err()
            {
                problems.error(format!("{at}.jwks_url '{url}' is not an http or https URL"));
            }
            JwksSource::Url(url)
        }
        (None, Some(file)) => JwksSource::File(file.into()),
        (Some(_), Some(_)) => {
            problems.error(format!("{at}: set jwks_url or jwks_file, not both"));
            return None;
        }
        (None, None) => {
            problems.error(format!(
                "{at}: set jwks_url (the identity provider's key set, e.g. \
                 https://login.example.com/.well-known/jwks.json) or jwks_file"
            ));
            return None;
        }
    };
    let user_claim = text(&raw.user_claim).unwrap_or_else(|| "sub".to_owned());
    let header = match text(&raw.header) {
        Some(header) => {
            if http::HeaderName::from_bytes(header.as_bytes()).is_err() {
                problems.error(format!("{at}.header '{header}' is not a header name"));
            }
            if !credential && header.eq_ignore_ascii_case("authorization") {
                problems.error(format!(
                    "{at}.header: Authorization carries the app's key; name another header for \
                     the user's token (e.g. X-User-Token)"
                ));
            }
            header
        }
        None if credential => "Authorization".to_owned(),
        None => {
            problems.error(format!(
                "{at}.header is required: the header the app sends each user's token in \
                 (e.g. X-User-Token)"
            ));
            String::new()
        }
    };
    let mut algorithms = list(&raw.algorithms);
    if raw.algorithms.is_none() {
        algorithms = DEFAULT_JWT_ALGORITHMS.map(str::to_owned).to_vec();
    }
    for name in &mut algorithms {
        match oqp_dataplane::auth::jwt::ALGORITHMS
            .iter()
            .find(|known| known.eq_ignore_ascii_case(name))
        {
            Some(known) => *name = (*known).to_owned(),
            None => problems.error(format!(
                "{at}.algorithms: '{name}' is not accepted (one of {}; none and HS* never are: \
                 a token's signature must come from the issuer's private key)",
                oqp_dataplane::auth::jwt::ALGORITHMS.join(", ")
            )),
        }
    }
    if algorithms.is_empty() {
        problems.error(format!("{at}.algorithms is empty"));
    }
    let allowed_hosts = list(&raw.allowed_hosts);
    let refresh_min_interval = raw
        .refresh_min_interval
        .map_or(DEFAULT_JWKS_MIN_INTERVAL, |seconds| seconds.0);
    if refresh_min_interval < Duration::from_secs(1) {
        problems.error(format!(
            "{at}.refresh_min_interval must be at least 1s (the issuer is asked at most that often)"
        ));
    }
    let claims_to_policy = raw
        .claims_to_policy
        .as_ref()
        .and_then(|raw| resolve_claims_to_policy(raw, &format!("{at}.claims_to_policy"), problems))
        .map(Box::new);
    (problems.error_count() == before).then_some(JwtConfig {
        issuer,
        audiences,
        jwks,
        user_claim,
        header,
        algorithms,
        allowed_hosts,
        refresh_min_interval,
        claims_to_policy,
    })
}

/// A `claims_to_policy` budget replaces `users.budget` for the users it selects, over the
/// same window: a user's usage is summed (over all data planes) by that window.
fn check_claim_budgets(users: &UsersConfig, at: &str, problems: &mut Problems) {
    let UserSource::Jwt(jwt) = &users.source else {
        return;
    };
    let Some(claims) = &jwt.claims_to_policy else {
        return;
    };
    for (index, policy) in claims.policies.iter().enumerate() {
        let Some(budget) = &policy.budget else {
            continue;
        };
        let here = format!("{at}.claims_to_policy.policies[{index}].budget");
        match &users.budget {
            Some(base) if base.window == budget.window => {}
            Some(base) => problems.error(format!(
                "{here}.window must be users.budget's ({}): a user's usage is summed over that \
                 window",
                base.window.as_str()
            )),
            None => problems.error(format!(
                "{here} needs users.budget: the window a user's usage is summed over, and the \
                 budget of users in no listed group"
            )),
        }
    }
}

/// The most `claims_to_policy.policies` a `jwt` block may list.
const MAX_CLAIM_POLICIES: usize = 256;

/// `jwt.claims_to_policy` at `at`: a `claim` and its `policies`, each a `value` with a
/// `max_priority` and/or `models`.
fn resolve_claims_to_policy(
    raw: &RawClaimsToPolicy,
    at: &str,
    problems: &mut Problems,
) -> Option<ClaimsToPolicy> {
    let before = problems.error_count();
    let claim = raw
        .claim
        .as_ref()
        .map(|text| text.0.trim().to_owned())
        .unwrap_or_default();
    if claim.is_empty() {
        problems.error(format!(
            "{at}.claim is required: the token's claim that holds the user's groups or roles \
             (e.g. groups)"
        ));
    }
    let raw_policies = raw.policies.as_deref().unwrap_or_default();
    if raw_policies.is_empty() {
        problems.error(format!(
            "{at}.policies is empty: list the claim's values and what each selects"
        ));
    } else if raw_policies.len() > MAX_CLAIM_POLICIES {
        problems.error(format!(
            "{at}.policies lists {} values; at most {MAX_CLAIM_POLICIES}",
            raw_policies.len()
        ));
    }
    let mut policies = Vec::new();
    for (index, policy) in raw_policies.iter().enumerate() {
        let value = policy
            .value
            .as_ref()
            .map(|text| text.0.trim().to_owned())
            .unwrap_or_default();
        let here = format!("{at}.policies[{index}]");
        if value.is_empty() {
            problems.error(format!(
                "{here}.value is required (the claim's value, e.g. admins)"
            ));
        } else if policies
            .iter()
            .any(|seen: &ClaimPolicy| seen.value == value)
        {
            problems.error(format!("{here}.value '{value}' is listed twice"));
        }
        let max_priority = word::<Tier>(
            policy.max_priority.as_ref(),
            &format!("{here}.max_priority"),
            problems,
        );
        let models = resolve_models(policy.models.as_deref(), &here, problems);
        let budget = policy
            .budget
            .as_ref()
            .and_then(|budget| resolve_budget(budget, &here, problems));
        if max_priority.is_none() && models.is_empty() && policy.budget.is_none() {
            problems.error(format!(
                "{here} selects nothing: set max_priority, models and/or budget"
            ));
        }
        policies.push(ClaimPolicy {
            value,
            max_priority,
            models,
            budget,
        });
    }
    (problems.error_count() == before).then_some(ClaimsToPolicy { claim, policies })
}

/// `auth.keys[].budget`: `gpu_seconds` and/or `tokens` per `window`.
fn resolve_budget(raw: &RawBudget, at: &str, problems: &mut Problems) -> Option<Budget> {
    let windows = || BudgetWindow::ALL.map(BudgetWindow::as_str).join(", ");
    let window = match raw.window.as_ref().map(|text| text.0.trim()) {
        None => {
            problems.error(format!(
                "{at}.budget.window is required (one of {})",
                windows()
            ));
            return None;
        }
        Some(text) => match BudgetWindow::parse(text) {
            Some(window) => window,
            None => {
                problems.error(format!(
                    "{at}.budget.window must be one of {}, got '{text}'",
                    windows()
                ));
                return None;
            }
        },
    };
    let gpu_ns = match raw.gpu_seconds {
        None => 0,
        Some(seconds) if seconds.0.is_zero() => {
            problems.error(format!("{at}.budget.gpu_seconds must be > 0"));
            return None;
        }
        Some(seconds) => u64::try_from(seconds.0.as_nanos()).unwrap_or(u64::MAX),
    };
    let tokens = match raw.tokens {
        None => 0,
        Some(tokens) if tokens.0 <= 0 => {
            problems.error(format!(
                "{at}.budget.tokens must be a positive integer, got {}",
                tokens.0
            ));
            return None;
        }
        Some(tokens) => tokens.0.unsigned_abs(),
    };
    let usd_micros = match raw.usd {
        None => 0,
        Some(usd) if !(usd.0.is_finite() && usd.0 > 0.0 && usd.0 <= 1e9) => {
            problems.error(format!(
                "{at}.budget.usd must be a positive amount of USD (at most 1e9), got {}",
                usd.0
            ));
            return None;
        }
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        Some(usd) => ((usd.0 * 1e6).round() as u64).max(1),
    };
    if gpu_ns == 0 && tokens == 0 && usd_micros == 0 {
        problems.error(format!(
            "{at}.budget sets none of gpu_seconds, tokens and usd; set one or more, or remove it"
        ));
        return None;
    }
    Some(Budget {
        gpu_ns,
        tokens,
        usd_micros,
        window,
    })
}

/// Builds a cloud host's pool: its configured keys, then `OLLAMA_API_KEY`, then the
/// comma-separated `OLLAMA_API_KEYS`; duplicates keep the first position and the first
/// non-empty account label. `None` if a configured key failed.
pub(crate) fn resolve_cloud_pool(
    host: &str,
    raw: &[RawCloudKey],
    env: &Env,
    problems: &mut Problems,
) -> Option<Vec<CloudKey>> {
    let before = problems.error_count();
    let mut candidates = Vec::new();
    for (index, entry) in raw.iter().enumerate() {
        let subject = format!("ollama.hosts[name='{host}'].api_keys[{index}]");
        let source = KeySource::key(
            entry.key.as_ref(),
            entry.key_env.as_ref(),
            entry.key_file.as_ref(),
        );
        if let Ok(Some(key)) = source.resolve(&subject, Required::ExactlyOne, env, problems) {
            let account = entry.account.as_ref().map(|text| text.0.trim().to_string());
            candidates.push(CloudKey {
                key,
                account: account.unwrap_or_default(),
            });
        }
    }
    if problems.error_count() != before {
        return None;
    }
    let from_env = env
        .get("OLLAMA_API_KEY")
        .into_iter()
        .chain(
            env.get("OLLAMA_API_KEYS")
                .into_iter()
                .flat_map(|list| list.split(',')),
        )
        .map(str::trim)
        .filter(|key| !key.is_empty());
    candidates.extend(from_env.map(|key| CloudKey {
        key: Secret::new(key),
        account: String::new(),
    }));

    let mut pool: Vec<CloudKey> = Vec::new();
    for candidate in candidates {
        match pool.iter_mut().find(|kept| kept.key == candidate.key) {
            Some(kept) if kept.account.is_empty() => kept.account = candidate.account,
            Some(_) => {}
            None => pool.push(candidate),
        }
    }
    Some(pool)
}

/// Parses an optional config word.
pub(crate) fn word<T: Vocabulary>(
    value: Option<&Text>,
    path: &str,
    problems: &mut Problems,
) -> Option<T> {
    parse_word(&value?.0, path, problems)
}

/// Parses RFC 3339 (`2026-12-31T23:59:59Z`, `…+02:00`, fractional seconds) or a bare date
/// (midnight UTC).
pub(crate) fn parse_timestamp(text: &str) -> Result<SystemTime, ()> {
    let text = text.trim();
    if text.len() == 10 {
        return humantime::parse_rfc3339(&format!("{text}T00:00:00Z")).map_err(|_| ());
    }
    let upper = text.to_ascii_uppercase();
    if upper.ends_with('Z') {
        return humantime::parse_rfc3339(&upper).map_err(|_| ());
    }
    // `±HH:MM` offset: parse the local part as UTC, then shift by the offset.
    let (local, offset) = upper.split_at(upper.len().saturating_sub(6));
    let bytes = offset.as_bytes();
    if bytes.len() != 6 || !matches!(bytes[0], b'+' | b'-') || bytes[3] != b':' {
        return Err(());
    }
    let hours: u64 = offset[1..3].parse().map_err(|_| ())?;
    let minutes: u64 = offset[4..6].parse().map_err(|_| ())?;
    if hours > 23 || minutes > 59 {
        return Err(());
    }
    let shift = Duration::from_secs(hours * 3600 + minutes * 60);
    let time = humantime::parse_rfc3339(&format!("{local}Z")).map_err(|_| ())?;
    let shifted = if bytes[0] == b'+' {
        time.checked_sub(shift)
    } else {
        time.checked_add(shift)
    };
    shifted.ok_or(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    #[test]
    fn timestamps() {
        let utc = parse_timestamp("2030-01-01T12:00:00Z").unwrap();
        assert_eq!(parse_timestamp("2030-01-01T14:00:00+02:00"), Ok(utc));
        assert_eq!(parse_timestamp("2030-01-01T10:30:00-01:30"), Ok(utc));
        assert_eq!(parse_timestamp("2030-01-01t12:00:00z"), Ok(utc));
        assert!(parse_timestamp("2030-01-01T12:00:00.250Z").is_ok());
        assert_eq!(
            parse_timestamp("2030-01-01"),
            humantime::parse_rfc3339("2030-01-01T00:00:00Z").map_err(|_| ())
        );
        assert!(parse_timestamp("next tuesday").is_err());
        assert!(parse_timestamp("2030-01-01T12:00:00+25:00").is_err());
    }

    #[test]
    fn cloud_pool_order_and_dedup() {
        let raw = vec![
            RawCloudKey {
                key: Some(Text("k1".into())),
                ..RawCloudKey::default()
            },
            RawCloudKey {
                key: Some(Text("k2".into())),
                account: Some(Text("me@example.com".into())),
                ..RawCloudKey::default()
            },
        ];
        let env = Env::from_pairs([
            ("OLLAMA_API_KEY", "k3"),
            ("OLLAMA_API_KEYS", "k2, k4,,k3 ,k5"),
        ]);
        let mut problems = Problems::default();
        let pool = resolve_cloud_pool("cloud", &raw, &env, &mut problems).unwrap();
        let keys: Vec<&str> = pool.iter().map(|key| key.key.expose()).collect();
        assert_eq!(keys, ["k1", "k2", "k3", "k4", "k5"]);
        assert_eq!(pool[1].account, "me@example.com");
        assert_eq!(pool[0].account, "");
    }
}
