use std::os::unix::fs::PermissionsExt;

use super::*;
use crate::policy::Policy;

fn metrics() -> Arc<Metrics> {
    let policy = Policy::try_from(crate::policy::minimal_wire()).unwrap();
    Arc::new(Metrics::new(&policy))
}

/// A directory of its own under the system's temporary directory, removed when dropped.
struct TempDir(PathBuf);

impl TempDir {
    fn new() -> Self {
        static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let path = std::env::temp_dir().join(format!("oqp-request-log-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&path);
        std::fs::create_dir_all(&path).unwrap();
        Self(path)
    }

    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn at(text: &str) -> SystemTime {
    humantime::parse_rfc3339(text).unwrap()
}

#[test]
fn day_files_sit_beside_the_configured_path() {
    assert_eq!(
        day_file(Path::new("/var/log/oqp/requests.jsonl"), "2026-12-04"),
        PathBuf::from("/var/log/oqp/requests.2026-12-04.jsonl")
    );
    assert_eq!(
        day_file(Path::new("requests"), "2026-12-04"),
        PathBuf::from("requests.2026-12-04")
    );
    let file = Path::new("/x/requests.jsonl");
    assert_eq!(
        date_in(file, "requests.2026-12-04.jsonl"),
        Some("2026-12-04")
    );
    assert_eq!(date_in(file, "requests.2026-12-04.jsonl.bak"), None);
    assert_eq!(date_in(file, "other.2026-12-04.jsonl"), None);
    assert_eq!(date_in(file, "requests.jsonl"), None);
    assert_eq!(days_before("2026-03-01", 1).as_deref(), Some("2026-02-28"));
}

#[test]
fn lines_go_to_the_day_file_0600_and_old_days_are_deleted() {
    let dir = TempDir::new();
    let file = dir.path().join("requests.jsonl");
    let settings = Settings {
        file: file.clone(),
        retention_days: 2,
    };
    // Three older days, one of them inside the retention, and a file of another name.
    for name in [
        "requests.2026-12-01.jsonl",
        "requests.2026-12-02.jsonl",
        "requests.2026-12-03.jsonl",
        "unrelated.2026-12-01.jsonl",
    ] {
        std::fs::write(dir.path().join(name), "{}\n").unwrap();
    }
    let mut writer = Writer::new(metrics());
    let entry = Entry {
        request_id: "rid-1".into(),
        client: "webui/ada".into(),
        user: Some("ada".into()),
        status: 200,
        ..Entry::default()
    };
    writer.write(&settings, &entry, at("2026-12-04T10:00:00Z"));
    writer.write(&settings, &entry, at("2026-12-04T23:59:59Z"));
    let today = dir.path().join("requests.2026-12-04.jsonl");
    let text = std::fs::read_to_string(&today).unwrap();
    let lines: Vec<serde_json::Value> = text
        .lines()
        .map(|line| serde_json::from_str(line).unwrap())
        .collect();
    assert_eq!(lines.len(), 2);
    assert_eq!(lines[0]["user"], "ada");
    assert_eq!(lines[0]["request_id"], "rid-1");
    assert!(lines[0].get("error").is_none(), "unset fields are left out");
    let mode = std::fs::metadata(&today).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600);
    let mut names: Vec<String> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|entry| entry.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(
        names,
        [
            "requests.2026-12-03.jsonl",
            "requests.2026-12-04.jsonl",
            "unrelated.2026-12-01.jsonl"
        ]
    );
    // The next day opens its own file.
    writer.write(&settings, &entry, at("2026-12-05T00:00:01Z"));
    assert!(dir.path().join("requests.2026-12-05.jsonl").exists());
}

#[test]
fn a_file_that_cannot_be_written_is_counted_and_nothing_else_happens() {
    let metrics = metrics();
    let mut writer = Writer::new(metrics.clone());
    let now = at("2026-12-04T10:00:00Z");
    // A directory that does not exist: the file cannot be opened.
    let missing = Settings {
        file: PathBuf::from("/nonexistent-oqp-dir/requests.jsonl"),
        retention_days: 1,
    };
    // A full disk: today's file is /dev/full, which opens and refuses every write.
    let dir = TempDir::new();
    std::os::unix::fs::symlink("/dev/full", dir.path().join("requests.2026-12-04.jsonl")).unwrap();
    let full = Settings {
        file: dir.path().join("requests.jsonl"),
        retention_days: 1,
    };
    for settings in [&missing, &full] {
        for _ in 0..3 {
            writer.write(settings, &Entry::default(), now);
        }
    }
    assert_eq!(metrics.request_log_counts(), (0, 6));
    // Logged once a minute, not once a line: the first failure set the time.
    let first = writer.last_warning.unwrap();
    writer.write(&full, &Entry::default(), now);
    assert_eq!(writer.last_warning, Some(first));
}
