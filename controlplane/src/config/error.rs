//! The loader's error type and the collector that lets it report every problem at once.

use std::io;
use std::path::PathBuf;

/// Why a configuration could not be loaded. `Display` prints one problem per line, ready to
/// show to the person who wrote the file.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file does not exist.
    #[error(
        "config file not found: {path}\nhint: copy examples/quickstart.yml to {path} and edit it (every setting: examples/config.example.yml)",
        path = path.display()
    )]
    NotFound { path: PathBuf },
    /// The file exists but cannot be read.
    #[error("cannot read config file {path}: {source}", path = path.display())]
    Unreadable {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// YAML syntax, schema, environment-override or semantic problems, all of them.
    #[error("{}", problems.join("\n"))]
    Invalid {
        /// One human-readable problem per entry, each naming its key path.
        problems: Vec<String>,
        /// Warnings found before giving up (unknown keys, deprecations).
        warnings: Vec<String>,
    },
}

impl ConfigError {
    /// Process exit code for a configuration error.
    pub const EXIT_CODE: i32 = 2;

    /// The exit code `main` should use: always [`ConfigError::EXIT_CODE`].
    pub fn exit_code(&self) -> i32 {
        Self::EXIT_CODE
    }

    /// The problems, one per line of the `Display` output.
    pub fn problems(&self) -> Vec<String> {
        match self {
            ConfigError::Invalid { problems, .. } => problems.clone(),
            other => other.to_string().lines().map(str::to_string).collect(),
        }
    }

    /// Warnings collected before the load failed.
    pub fn warnings(&self) -> &[String] {
        match self {
            ConfigError::Invalid { warnings, .. } => warnings,
            _ => &[],
        }
    }
}

/// Errors and warnings gathered while loading; the load fails if any error was recorded.
#[derive(Debug, Default)]
pub(crate) struct Problems {
    errors: Vec<String>,
    warnings: Vec<String>,
}

impl Problems {
    pub(crate) fn error(&mut self, message: impl Into<String>) {
        self.errors.push(message.into());
    }

    pub(crate) fn warn(&mut self, message: impl Into<String>) {
        self.warnings.push(message.into());
    }

    #[cfg(test)]
    pub(crate) fn errors(&self) -> &[String] {
        &self.errors
    }

    #[cfg(test)]
    pub(crate) fn warnings(&self) -> &[String] {
        &self.warnings
    }

    #[cfg(test)]
    pub(crate) fn is_empty(&self) -> bool {
        self.errors.is_empty() && self.warnings.is_empty()
    }

    /// Number of errors so far; compare before and after a step to see whether it failed.
    pub(crate) fn error_count(&self) -> usize {
        self.errors.len()
    }

    /// The value with its warnings, or every error.
    pub(crate) fn finish<T>(self, value: Option<T>) -> Result<(T, Vec<String>), ConfigError> {
        match value {
            Some(value) if self.errors.is_empty() => Ok((value, self.warnings)),
            _ => Err(ConfigError::Invalid {
                problems: if self.errors.is_empty() {
                    // Unreachable by construction: a step returns `None` only after an error.
                    vec!["invalid configuration".to_string()]
                } else {
                    self.errors
                },
                warnings: self.warnings,
            }),
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    #[test]
    fn display_is_one_problem_per_line() {
        let error = ConfigError::Invalid {
            problems: vec!["proxy.port: a".into(), "ollama.hosts: b".into()],
            warnings: vec![],
        };
        assert_eq!(error.to_string(), "proxy.port: a\nollama.hosts: b");
        assert_eq!(error.exit_code(), 2);

        let missing = ConfigError::NotFound {
            path: "/etc/oqp.yml".into(),
        };
        let lines = missing.problems();
        assert_eq!(lines[0], "config file not found: /etc/oqp.yml");
        assert!(lines[1].starts_with("hint: copy examples/quickstart.yml"));
    }
}
