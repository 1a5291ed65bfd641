//! The Debian package, installed and started: `scripts/deb.sh` packages the binaries this
//! test run built (the debug profile, to keep CI short: the recipe is the same for `dist`),
//! `dpkg -i` installs it, and the installed unit's `ExecStart` command, run as the unit's
//! user with its environment and working directory, answers 200 on `/health`. Then
//! `dpkg --purge` removes it again.
//!
//! It changes the machine (a package, a system user), so it needs root and `dpkg`: CI runs
//! as root on Debian. Elsewhere it says why it did nothing and passes.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

const UNIT: &str = "/lib/systemd/system/oqp-controlplane.service";

fn run(command: &mut Command) -> Output {
    let output = command.output().unwrap();
    assert!(
        output.status.success(),
        "{command:?} failed: {}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    output
}

/// Where this run's binaries are: the test executable is `<profile dir>/deps/deb-…`.
fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    exe.parent().unwrap().parent().unwrap().to_owned()
}

fn repository() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_owned()
}

fn can_install() -> Result<(), String> {
    let uid = Command::new("id")
        .arg("-u")
        .output()
        .map_err(|e| e.to_string())?;
    if String::from_utf8_lossy(&uid.stdout).trim() != "0" {
        return Err("not root".into());
    }
    for tool in ["dpkg", "dpkg-deb", "setpriv"] {
        let found = Command::new("sh")
            .args(["-c", &format!("command -v {tool}")])
            .output()
            .map_err(|e| e.to_string())?;
        if !found.status.success() {
            return Err(format!("no {tool}"));
        }
    }
    for binary in ["oqp-controlplane", "oqp-dataplane", "oqpctl"] {
        if !profile_dir().join(binary).exists() {
            return Err(format!(
                "{binary} not built in {} (cargo test --workspace builds it)",
                profile_dir().display()
            ));
        }
    }
    Ok(())
}

/// The unit's settings for the service: `(ExecStart, Environment, User, WorkingDirectory)`.
fn unit_settings(unit: &str) -> (String, Vec<(String, String)>, String, String) {
    let value = |key: &str| {
        unit.lines()
            .find_map(|line| line.strip_prefix(&format!("{key}=")))
            .unwrap_or_else(|| panic!("no {key}= in the unit:\n{unit}"))
            .to_owned()
    };
    let environment = unit
        .lines()
        .filter_map(|line| line.strip_prefix("Environment="))
        .map(|pair| {
            let (name, value) = pair.split_once('=').unwrap();
            (name.to_owned(), value.to_owned())
        })
        .collect();
    (
        value("ExecStart"),
        environment,
        value("User"),
        value("WorkingDirectory"),
    )
}

/// `GET /health` over a plain socket: the status code, or `None` while nothing answers.
fn health(port: u16) -> Option<u16> {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    stream
        .write_all(b"GET /health HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
        .ok()?;
    let mut answer = String::new();
    stream.read_to_string(&mut answer).ok()?;
    answer.split_whitespace().nth(1)?.parse().ok()
}

/// Removes the package (and what postrm removes on purge), whatever state it is in.
fn purge() {
    let _ = Command::new("dpkg").args(["--purge", "oqp"]).output();
}

/// Purges on the way out, pass or fail, and stops the service if it runs.
struct Installed(Option<std::process::Child>);

impl Drop for Installed {
    fn drop(&mut self) {
        if let Some(child) = &mut self.0 {
            let _ = child.kill();
            let _ = child.wait();
        }
        purge();
    }
}

#[test]
fn the_debian_package_installs_and_its_unit_command_serves_health() {
    if let Err(why) = can_install() {
        eprintln!("skipped: the package test needs root, dpkg and the built binaries ({why})");
        return;
    }
    purge();
    let out = tempfile::tempdir().unwrap();
    let built = run(Command::new(repository().join("scripts/deb.sh"))
        .args(["--no-build", "--bin-dir"])
        .arg(profile_dir())
        .arg("--out")
        .arg(out.path())
        .arg("debug"));
    let deb = String::from_utf8_lossy(&built.stdout).trim().to_owned();
    let size = std::fs::metadata(&deb).unwrap().len();
    println!("{deb}: {size} bytes (debug binaries)");

    let mut installed = Installed(None);
    run(Command::new("dpkg").arg("-i").arg(&deb));
    for binary in ["oqp-controlplane", "oqp-dataplane", "oqpctl"] {
        assert!(Path::new("/usr/bin").join(binary).exists(), "{binary}");
    }
    // The system user, the config as a conffile readable by its group only.
    run(Command::new("getent").args(["passwd", "oqp"]));
    let conffiles = run(Command::new("dpkg-query").args(["-W", "-f=${Conffiles}", "oqp"]));
    assert!(
        String::from_utf8_lossy(&conffiles.stdout).contains("/etc/oqp/config.yml"),
        "not a conffile"
    );
    let stat = run(Command::new("stat").args(["-c", "%a %U %G", "/etc/oqp/config.yml"]));
    assert_eq!(String::from_utf8_lossy(&stat.stdout).trim(), "640 root oqp");
    let state = run(Command::new("stat").args(["-c", "%a %U", "/var/lib/oqp"]));
    assert_eq!(String::from_utf8_lossy(&state.stdout).trim(), "700 oqp");

    // The unit's command, as systemd would run it (without systemd, which CI lacks): its
    // user, environment and working directory. The installed config listens on 11435 and
    // 50051; a free port and any port stand in, through the config's environment overrides.
    let unit = std::fs::read_to_string(UNIT).unwrap();
    let (exec_start, environment, user, directory) = unit_settings(&unit);
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut words = exec_start.split_whitespace();
    let program = words.next().unwrap();
    assert_eq!(program, "/usr/bin/oqp-controlplane");
    // setpriv execs the service in its own process (runuser would fork, and killing it
    // would leave the service running).
    let child = Command::new("setpriv")
        .args([
            "--reuid",
            &user,
            "--regid",
            &user,
            "--init-groups",
            "--",
            program,
        ])
        .args(words)
        .envs(environment)
        .env("OQP_PROXY__PORT", port.to_string())
        .env("OQP_CONTROL_PLANE__LISTEN", "127.0.0.1:0")
        .current_dir(&directory)
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    installed.0 = Some(child);
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(status) = health(port) {
            break status;
        }
        let child = installed.0.as_mut().unwrap();
        if let Some(exit) = child.try_wait().unwrap() {
            panic!("the service exited: {exit}");
        }
        assert!(Instant::now() < deadline, "no answer on /health in 30 s");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(status, 200);
    drop(installed);
    assert!(!Path::new("/usr/bin/oqp-controlplane").exists(), "purged");
    assert!(
        !Path::new("/var/lib/oqp").exists(),
        "purge removes the state"
    );
}
