//! The small closed vocabularies of the config file: tiers, scopes, host kinds, strategies,
//! log settings and webhook events. Each parses case-insensitively from its config spelling and
//! prints back with `as_str`.

use std::cmp::Ordering;
use std::fmt;
use std::str::FromStr;

use super::error::Problems;

/// An enum with config spellings.
pub(crate) trait Vocabulary: FromStr<Err = ()> {
    /// The accepted spellings, for error messages (`a, b or c`).
    fn expected() -> String;
}

/// Parses a config word, recording `{path}: unknown value 'x' (expected a, b or c)`.
pub(crate) fn parse_word<T: Vocabulary>(
    text: &str,
    path: &str,
    problems: &mut Problems,
) -> Option<T> {
    match text.parse::<T>() {
        Ok(value) => Some(value),
        Err(()) => {
            problems.error(format!(
                "{path}: unknown value '{}' (expected {})",
                text.trim(),
                T::expected()
            ));
            None
        }
    }
}

/// Generates `as_str`, `Display`, `FromStr` (case-insensitive) and an `ALL` list for an enum
/// whose variants map one-to-one onto config spellings.
macro_rules! vocabulary {
    ($(#[$meta:meta])* $name:ident { $($(#[$vmeta:meta])* $variant:ident => $text:literal),+ $(,)? }) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum $name {
            $($(#[$vmeta])* $variant),+
        }

        impl $name {
            /// Every value, in declaration order.
            pub const ALL: &'static [$name] = &[$($name::$variant),+];

            /// The spelling used in the config file and in messages.
            pub fn as_str(self) -> &'static str {
                match self {
                    $($name::$variant => $text),+
                }
            }

        }

        impl Vocabulary for $name {
            fn expected() -> String {
                or_list(&[$($text),+])
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl FromStr for $name {
            type Err = ();

            fn from_str(text: &str) -> Result<Self, ()> {
                let text = text.trim();
                $(if text.eq_ignore_ascii_case($text) {
                    return Ok($name::$variant);
                })+
                Err(())
            }
        }
    };
}

vocabulary! {
    /// A queue tier. Ordered by priority: `High > Normal > Low`.
    Tier {
        High => "high",
        Normal => "normal",
        Low => "low",
    }
}

vocabulary! {
    /// What a key may do. Cumulative and ordered: `Read < Inference < Management`.
    Scope {
        /// Status, summary, metrics and dashboard only.
        Read => "read",
        /// Everything `Read` may, plus proxying to Ollama.
        Inference => "inference",
        /// Everything `Inference` may, plus pause, resume, drain and flush.
        Management => "management",
    }
}

vocabulary! {
    /// What sits behind an upstream URL.
    HostKind {
        /// A self-hosted Ollama daemon.
        Ollama => "ollama",
        /// Ollama Cloud (`https://ollama.com`), reached with a pool of API keys.
        Cloud => "cloud",
        /// An OpenAI-compatible engine (llama.cpp's llama-server, llama-swap, vLLM…): health
        /// from `/health`, models from `/v1/models`, slots from llama-server's `/props`.
        Openai => "openai",
        /// Detected on each poll: Ollama if it answers `/api/version`, else `openai` if it
        /// answers `/props` (llama-server) or lists `/v1/models`.
        Auto => "auto",
    }
}

vocabulary! {
    /// How a host is picked for a request.
    RoutingStrategy {
        /// Prefer hosts that list the requested model in `/api/tags`, else weighted round-robin.
        ModelAware => "model_aware",
        /// Weighted round-robin over reachable hosts, ignoring models.
        RoundRobin => "round_robin",
    }
}

vocabulary! {
    /// What `model_aware` routing does when no host has the model.
    RoutingFallback {
        /// Weighted round-robin over every reachable host.
        AnyHealthy => "any_healthy",
    }
}

vocabulary! {
    /// Log line format.
    LogFormat {
        Text => "text",
        Json => "json",
    }
}

vocabulary! {
    /// Log verbosity; `as_str` is a valid `tracing` filter directive.
    LogLevel {
        Error => "error",
        Warn => "warn",
        Info => "info",
        Debug => "debug",
        Trace => "trace",
    }
}

vocabulary! {
    /// An event a webhook can be subscribed to.
    WebhookEvent {
        QueueFull => "queue.full",
        QueueHighWatermark => "queue.high_watermark",
        QueueDrained => "queue.drained",
        QueueOverCapacity => "queue.over_capacity",
        HostUnhealthy => "host.unhealthy",
        HostRecovered => "host.recovered",
        KeyRevoked => "key.revoked",
        KeyRotated => "key.rotated",
        ClientBudgetExceeded => "client.budget_exceeded",
        Audit => "audit",
        CloudUnderReserve => "cloud.under_reserve",
        CloudRefused => "cloud.refused",
    }
}

/// Joins spellings for a message: `a`, `a or b`, `a, b or c`.
pub(crate) fn or_list(items: &[&str]) -> String {
    match items {
        [] => String::new(),
        [only] => (*only).to_string(),
        [init @ .., last] => format!("{} or {last}", init.join(", ")),
    }
}

impl Tier {
    fn rank(self) -> u8 {
        match self {
            Tier::High => 2,
            Tier::Normal => 1,
            Tier::Low => 0,
        }
    }
}

impl Ord for Tier {
    fn cmp(&self, other: &Self) -> Ordering {
        self.rank().cmp(&other.rank())
    }
}

impl PartialOrd for Tier {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Scope {
    fn cmp(&self, other: &Self) -> Ordering {
        (*self as u8).cmp(&(*other as u8))
    }
}

impl PartialOrd for Scope {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl LogLevel {
    /// Parses a level, also accepting the Python logging names an existing config may carry
    /// (`WARNING`, `CRITICAL`, `FATAL`).
    pub(crate) fn parse_lenient(text: &str) -> Option<Self> {
        let text = text.trim();
        if text.eq_ignore_ascii_case("warning") {
            return Some(LogLevel::Warn);
        }
        if text.eq_ignore_ascii_case("critical") || text.eq_ignore_ascii_case("fatal") {
            return Some(LogLevel::Error);
        }
        text.parse().ok()
    }
}

impl WebhookEvent {
    /// The events a webhook receives when `webhooks.events` is not given.
    pub const DEFAULTS: &'static [WebhookEvent] = &[
        WebhookEvent::QueueFull,
        WebhookEvent::QueueHighWatermark,
        WebhookEvent::QueueDrained,
        WebhookEvent::HostUnhealthy,
        WebhookEvent::HostRecovered,
    ];
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    #[test]
    fn tiers_order_by_priority() {
        assert!(Tier::High > Tier::Normal && Tier::Normal > Tier::Low);
        assert_eq!(Tier::High.min(Tier::Normal), Tier::Normal);
        assert_eq!(Tier::ALL, &[Tier::High, Tier::Normal, Tier::Low]);
        assert_eq!("HIGH".parse(), Ok(Tier::High));
        assert_eq!(Tier::Low.as_str(), "low");
        assert!("urgent".parse::<Tier>().is_err());
    }

    #[test]
    fn scopes_are_cumulative() {
        assert!(Scope::Read < Scope::Inference && Scope::Inference < Scope::Management);
        assert_eq!(Scope::expected(), "read, inference or management");
    }

    #[test]
    fn python_log_level_names_are_accepted() {
        assert_eq!(LogLevel::parse_lenient("WARNING"), Some(LogLevel::Warn));
        assert_eq!(LogLevel::parse_lenient("Info"), Some(LogLevel::Info));
        assert_eq!(LogLevel::parse_lenient("CRITICAL"), Some(LogLevel::Error));
        assert_eq!(LogLevel::parse_lenient("verbose"), None);
    }

    #[test]
    fn webhook_event_spellings() {
        assert_eq!(
            "queue.high_watermark".parse(),
            Ok(WebhookEvent::QueueHighWatermark)
        );
        assert_eq!(WebhookEvent::DEFAULTS.len(), 5);
        assert_eq!(WebhookEvent::KeyRotated.as_str(), "key.rotated");
    }
}
