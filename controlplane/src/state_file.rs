//! A state file on disk (the key store, the usage ledger's days, the policy
//! version, the node token): read once at start, replaced atomically on every
//! change.
//!
//! A write is the classic rename dance: a new file in the same directory,
//! created with mode 0600 (so it is never readable by others, not even
//! between creation and a `chmod`), written, fsynced, renamed over the old
//! one, and the directory fsynced so that the rename itself is durable. A
//! crash at any moment leaves the old content or the new, never a mix; a
//! crash before the rename may leave a temporary file behind, which the next
//! start removes.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

/// The file's content, or `None` if it does not exist yet.
pub(crate) fn read(path: &Path) -> io::Result<Option<Vec<u8>>> {
    match fs::read(path) {
        Ok(bytes) => Ok(Some(bytes)),
        Err(error) if error.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(error) => Err(error),
    }
}

/// The permission bits of `path` if group or others may access it.
pub(super) fn shared_mode(path: &Path) -> Option<u32> {
    let mode = fs::metadata(path).ok()?.permissions().mode() & 0o777;
    (mode & 0o077 != 0).then_some(mode)
}

/// Replaces `path` with `contents`: old or new content survive a crash,
/// nothing in between. Creates the directory (mode 0700) if needed.
pub(crate) fn write_atomic(path: &Path, contents: &[u8]) -> io::Result<()> {
    let dir = parent(path);
    if !dir.exists() {
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)?;
        // The new directory's entry must be durable too, or the file is lost with it.
        sync_dir(parent(dir))?;
    }
    let temporary = temporary_path(path);
    let written = write_new(&temporary, contents)
        .and_then(|()| fs::rename(&temporary, path))
        .and_then(|()| sync_dir(dir));
    if written.is_err() {
        // Harmless if the rename already happened: then there is nothing to remove.
        let _ = fs::remove_file(&temporary);
    }
    written
}

/// Removes temporaries a crash left beside `path`.
pub(crate) fn remove_temporaries(path: &Path) {
    let Some(prefix) = temporary_prefix(path) else {
        return;
    };
    let Ok(entries) = fs::read_dir(parent(path)) else {
        return;
    };
    for entry in entries.flatten() {
        if entry.file_name().to_string_lossy().starts_with(&prefix) {
            let _ = fs::remove_file(entry.path());
        }
    }
}

fn write_new(path: &Path, contents: &[u8]) -> io::Result<()> {
    let mut file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)?;
    file.write_all(contents)?;
    file.sync_all()
}

fn sync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}

fn parent(path: &Path) -> &Path {
    match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir,
        _ => Path::new("."),
    }
}

fn temporary_prefix(path: &Path) -> Option<String> {
    Some(format!(".{}.tmp-", path.file_name()?.to_string_lossy()))
}

fn temporary_path(path: &Path) -> PathBuf {
    let prefix = temporary_prefix(path).unwrap_or_else(|| ".store.tmp-".to_owned());
    parent(path).join(format!("{prefix}{:016x}", rand::random::<u64>()))
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    #[test]
    fn writes_replace_whole_files_with_mode_0600() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state").join("keys.json");
        assert_eq!(read(&path).unwrap(), None);
        write_atomic(&path, b"first").unwrap();
        write_atomic(&path, b"second").unwrap();
        assert_eq!(read(&path).unwrap().as_deref(), Some(&b"second"[..]));
        let mode = fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        assert_eq!(shared_mode(&path), None);
        let dir_mode = fs::metadata(path.parent().unwrap())
            .unwrap()
            .permissions()
            .mode()
            & 0o777;
        assert_eq!(dir_mode & 0o077, 0, "state dir mode {dir_mode:o}");
        // No temporary is left behind.
        let names: Vec<_> = fs::read_dir(path.parent().unwrap())
            .unwrap()
            .map(|entry| entry.unwrap().file_name())
            .collect();
        assert_eq!(names, ["keys.json"]);
    }

    #[test]
    fn leftover_temporaries_are_removed_and_others_kept() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("keys.json");
        fs::write(dir.path().join(".keys.json.tmp-0123"), b"half").unwrap();
        fs::write(dir.path().join("other"), b"keep").unwrap();
        remove_temporaries(&path);
        let mut names: Vec<_> = fs::read_dir(dir.path())
            .unwrap()
            .map(|entry| entry.unwrap().file_name().into_string().unwrap())
            .collect();
        names.sort();
        assert_eq!(names, ["other"]);
    }

    #[test]
    fn shared_files_are_noticed() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("keys.json");
        fs::write(&path, b"{}").unwrap();
        fs::set_permissions(&path, fs::Permissions::from_mode(0o644)).unwrap();
        assert_eq!(shared_mode(&path), Some(0o644));
    }
}
