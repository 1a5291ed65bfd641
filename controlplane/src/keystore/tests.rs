//! Key store semantics against a real hub and a real file in a temporary
//! directory, with the clock passed in.

use std::os::unix::fs::PermissionsExt;

use sha2::{Digest, Sha256};

use super::*;
use crate::config::{Env, load_str};

const CONFIG: &str = "\
proxy: {max_concurrent: 4}
ollama: {hosts: [{url: 'http://127.0.0.1:9', name: a}]}
auth:
  enabled: true
  keys:
    - {key: sk-admin-0123456789, client_id: admin, scope: management}
";

const T0: u64 = 1_800_000_000_000;

fn at(ms: u64) -> SystemTime {
    SystemTime::UNIX_EPOCH + Duration::from_millis(ms)
}

fn ms(ms: u64) -> i64 {
    i64::try_from(ms).unwrap()
}

fn hub() -> Arc<Hub> {
    Hub::new(load_str(CONFIG, &Env::empty()).unwrap().config)
}

fn open(dir: &Path) -> Arc<KeyStore> {
    KeyStore::load(dir, hub()).unwrap()
}

fn new_key(client_id: &str) -> NewKey {
    NewKey {
        client_id: client_id.to_owned(),
        scope: Scope::Inference,
        max_priority: Tier::High,
        default_priority: None,
        max_concurrent: 2,
        weight: 2.0,
        max_queued: 5,
        description: "batch jobs".to_owned(),
        lifetime: None,
        budget: None,
        models: Vec::new(),
    }
}

fn digest(key: &Secret) -> [u8; 32] {
    Sha256::digest(key.expose().as_bytes()).into()
}

fn published(store: &KeyStore) -> Vec<(String, Vec<u8>)> {
    store
        .hub
        .current()
        .clients
        .iter()
        .filter(|client| client.source == "store")
        .map(|client| (client.client_id.clone(), client.key_sha256.clone()))
        .collect()
}

#[test]
fn an_added_key_is_durable_published_and_never_stored_in_clear() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path());
    let before = store.hub.current().version;
    let issued = store.add(new_key("batch"), at(T0)).unwrap();
    let key = issued.key.expose().to_owned();
    assert!(key.starts_with(PREFIX));
    assert!(issued.snapshot_version > before);
    assert_eq!(issued.record.created_unix_ms, ms(T0));
    assert_eq!(issued.record.default_priority, Tier::Normal);
    assert_eq!(
        published(&store),
        [("batch".to_owned(), digest(&issued.key).to_vec())]
    );
    assert_eq!(
        store.scope_of(&digest(&issued.key), ms(T0)),
        Some(Scope::Inference)
    );

    let path = dir.path().join(FILE_NAME);
    let text = std::fs::read_to_string(&path).unwrap();
    assert!(!text.contains(&key));
    assert!(!text.contains(&key[PREFIX.len()..]));
    assert!(text.contains(&hex::encode(digest(&issued.key))));
    let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600);
    assert!(!format!("{store:?}").contains(&key));

    // A restart sees the same store.
    let reopened = open(dir.path());
    assert_eq!(reopened.records(), store.records());
    assert_eq!(published(&reopened), published(&store));
}

#[test]
fn add_refuses_existing_ids_and_out_of_range_limits() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path());
    store.add(new_key("batch"), at(T0)).unwrap();
    let refused = |new: NewKey| store.add(new, at(T0)).unwrap_err();
    assert!(matches!(
        refused(new_key("admin")),
        KeyError::DefinedInConfig(id) if id == "admin"
    ));
    assert!(matches!(
        refused(new_key(" batch ")),
        KeyError::AlreadyStored(id) if id == "batch"
    ));
    let cases: [(NewKey, &str); 6] = [
        (new_key(""), "must not be empty"),
        (new_key("two words"), "visible ASCII"),
        (
            NewKey {
                max_concurrent: 5,
                ..new_key("x")
            },
            "exceeds proxy.max_concurrent (4)",
        ),
        (
            NewKey {
                weight: 0.0,
                ..new_key("x")
            },
            "weight must be a number > 0",
        ),
        (
            NewKey {
                max_priority: Tier::Low,
                default_priority: Some(Tier::Normal),
                ..new_key("x")
            },
            "default_priority normal is above max_priority low",
        ),
        (
            NewKey {
                lifetime: Some(Duration::ZERO),
                ..new_key("x")
            },
            "positive duration",
        ),
    ];
    for (new, expected) in cases {
        let error = refused(new);
        assert!(matches!(error, KeyError::Invalid(_)), "{error:?}");
        assert!(error.to_string().contains(expected), "{error}");
    }
    assert_eq!(store.records().len(), 1);
}

#[test]
fn rotation_keeps_the_old_key_for_its_grace_period_only() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path());
    let first = store.add(new_key("batch"), at(T0)).unwrap();
    let second = store
        .rotate("batch", Duration::from_secs(60), at(T0 + 1_000))
        .unwrap();
    assert_ne!(first.key, second.key);
    assert_eq!(second.old_key_until_unix_ms, ms(T0 + 61_000));
    assert_eq!(second.record.created_unix_ms, ms(T0 + 1_000));

    // Both work during grace, and the current key comes first.
    let during = clients(&store.records(), ms(T0 + 2_000));
    let digests: Vec<_> = during.iter().map(|c| c.key_sha256.clone()).collect();
    assert_eq!(
        digests,
        [digest(&second.key).to_vec(), digest(&first.key).to_vec()]
    );
    assert_eq!(during[1].expires_unix_ms, ms(T0 + 61_000));
    assert_eq!(
        store.scope_of(&digest(&first.key), ms(T0 + 60_999)),
        Some(Scope::Inference)
    );
    assert_eq!(store.next_deadline(ms(T0 + 2_000)), Some(ms(T0 + 61_000)));

    // After grace only the new key is left.
    let after = clients(&store.records(), ms(T0 + 61_000));
    assert_eq!(after.len(), 1);
    assert_eq!(store.scope_of(&digest(&first.key), ms(T0 + 61_000)), None);
    assert_eq!(store.next_deadline(ms(T0 + 61_000)), None);

    // The next change drops the spent digest from the file.
    let third = store
        .rotate("batch", Duration::ZERO, at(T0 + 70_000))
        .unwrap();
    assert_eq!(third.old_key_until_unix_ms, ms(T0 + 70_000));
    assert!(store.records()[0].previous.is_empty());
    assert_eq!(store.scope_of(&digest(&second.key), ms(T0 + 70_000)), None);
}

#[test]
fn passed_deadlines_name_expiries_and_grace_ends_once() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path());
    let mut brief = new_key("brief");
    brief.lifetime = Some(Duration::from_secs(10));
    store.add(brief, at(T0)).unwrap();
    store.add(new_key("batch"), at(T0)).unwrap();
    store
        .rotate("batch", Duration::from_secs(60), at(T0 + 1_000))
        .unwrap();
    assert!(store.passed_deadlines(ms(T0), ms(T0 + 9_999)).is_empty());
    assert_eq!(
        store.passed_deadlines(ms(T0), ms(T0 + 10_000)),
        [("brief".to_owned(), "keys.expire")]
    );
    assert_eq!(
        store.passed_deadlines(ms(T0 + 10_000), ms(T0 + 61_000)),
        [("batch".to_owned(), "keys.grace_end")]
    );
    assert!(
        store
            .passed_deadlines(ms(T0 + 61_000), ms(T0 + 90_000))
            .is_empty()
    );
}

#[test]
fn rotation_never_extends_an_expiring_key() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path());
    let expiring = NewKey {
        lifetime: Some(Duration::from_secs(10)),
        ..new_key("temp")
    };
    let first = store.add(expiring, at(T0)).unwrap();
    assert_eq!(first.record.expires_unix_ms, ms(T0 + 10_000));
    let second = store
        .rotate("temp", Duration::from_secs(3600), at(T0 + 5_000))
        .unwrap();
    assert_eq!(second.record.expires_unix_ms, ms(T0 + 10_000));
    assert_eq!(second.old_key_until_unix_ms, ms(T0 + 10_000));
    assert_eq!(store.next_deadline(ms(T0 + 5_000)), Some(ms(T0 + 10_000)));
    assert!(clients(&store.records(), ms(T0 + 10_000)).is_empty());
    assert!(matches!(
        store.rotate("temp", Duration::ZERO, at(T0 + 10_000)),
        Err(KeyError::Expired(_))
    ));
    // Listed until revoked, but never published.
    assert_eq!(store.records().len(), 1);
    store.republish(at(T0 + 10_000));
    assert!(published(&store).is_empty());
}

#[test]
fn revoke_removes_every_key_of_the_client_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path());
    let first = store.add(new_key("batch"), at(T0)).unwrap();
    store
        .rotate("batch", Duration::from_secs(600), at(T0))
        .unwrap();
    store.add(new_key("other"), at(T0)).unwrap();
    store.revoke("batch", at(T0 + 1)).unwrap();
    assert_eq!(store.scope_of(&digest(&first.key), ms(T0 + 1)), None);
    let ids: Vec<_> = published(&store).into_iter().map(|(id, _)| id).collect();
    assert_eq!(ids, ["other"]);
    assert_eq!(open(dir.path()).records().len(), 1);
}

#[test]
fn config_keys_are_read_only_and_unknown_ids_are_not_found() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path());
    let error = store.revoke("admin", at(T0)).unwrap_err();
    assert!(matches!(error, KeyError::ReadOnly(_)));
    assert!(error.to_string().contains("edit its auth.keys entry"));
    assert!(matches!(
        store.rotate("admin", Duration::ZERO, at(T0)),
        Err(KeyError::ReadOnly(_))
    ));
    assert!(matches!(
        store.revoke("nobody", at(T0)),
        Err(KeyError::NotFound(_))
    ));
    // Nothing was written for refusals.
    assert!(!dir.path().join(FILE_NAME).exists());
}

#[test]
fn a_corrupt_store_is_a_start_up_error_naming_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(FILE_NAME);
    std::fs::write(&path, b"{\"format\": 1, \"keys\": [").unwrap();
    let error = KeyStore::load(dir.path(), hub()).unwrap_err();
    assert!(matches!(error, StoreError::Corrupt { .. }));
    let message = error.to_string();
    assert!(message.contains(&path.display().to_string()), "{message}");
    assert!(message.contains("move it aside"), "{message}");
    // Left as it was.
    assert_eq!(
        std::fs::read(&path).unwrap(),
        b"{\"format\": 1, \"keys\": ["
    );
}

#[test]
fn an_unwritable_store_refuses_the_change_and_keeps_the_old_state() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    let store = open(&state);
    // The state dir turns into a file: nothing can be created under it.
    std::fs::write(&state, b"").unwrap();
    let error = store.add(new_key("batch"), at(T0)).unwrap_err();
    assert!(matches!(error, KeyError::Unwritable { .. }), "{error:?}");
    assert!(error.to_string().contains("nothing was changed"));
    assert!(store.records().is_empty());
    assert!(published(&store).is_empty());
}

#[test]
fn the_hub_drops_expired_store_clients_from_every_snapshot() {
    let hub = hub();
    let client = |id: &str, expires_unix_ms: i64| wire::Client {
        client_id: id.to_owned(),
        key_sha256: vec![id.len() as u8; 32],
        expires_unix_ms,
        source: "store".to_owned(),
        ..wire::Client::default()
    };
    hub.set_extra_clients(vec![
        client("past", 1),
        client("never", 0),
        client("future", i64::MAX),
    ]);
    let ids: Vec<_> = hub
        .current()
        .clients
        .iter()
        .filter(|c| c.source == "store")
        .map(|c| c.client_id.clone())
        .collect();
    assert_eq!(ids, ["never", "future"]);
}

#[test]
fn warnings_name_clients_defined_twice() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path());
    store.add(new_key("later-in-config"), at(T0)).unwrap();
    let config = load_str(
        &format!("{CONFIG}    - {{key: sk-other-0123456789, client_id: later-in-config}}\n"),
        &Env::empty(),
    )
    .unwrap()
    .config;
    let warnings = store.warnings(&config);
    assert_eq!(warnings.len(), 1);
    assert!(warnings[0].contains("'later-in-config'"));
}

#[test]
fn rotations_and_revocations_queue_their_webhooks() {
    let dir = tempfile::tempdir().unwrap();
    let yaml = format!(
        "{CONFIG}webhooks: {{enabled: true, url: 'http://192.0.2.1/hook', events: [key.rotated, key.revoked]}}\n"
    );
    let hub = Hub::new(load_str(&yaml, &Env::empty()).unwrap().config);
    let store = KeyStore::load(dir.path(), hub.clone()).unwrap();
    store.add(new_key("batch"), at(T0)).unwrap();
    assert_eq!(hub.webhooks().stats().queued, 0);
    store.rotate("batch", Duration::ZERO, at(T0)).unwrap();
    store.revoke("batch", at(T0)).unwrap();
    assert_eq!(hub.webhooks().stats().queued, 2);
    // Refusals announce nothing.
    let _ = store.revoke("batch", at(T0));
    assert_eq!(hub.webhooks().stats().queued, 2);
}
