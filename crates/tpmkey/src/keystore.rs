//! A directory of named keys.
//!
//! Layout (directory mode 0700):
//! * `NAME.key.pem`  – the `TSS2 PRIVATE KEY` (mode 0600).  The TPM wraps
//!   the private part, but the file still lets anyone with access to *this*
//!   TPM use the key (subject to its PIN/PCR policy), so it is kept private.
//! * `NAME.pub.pem`  – the public key as SubjectPublicKeyInfo PEM, for
//!   encrypting to the key with ordinary tools.
//! * `NAME.json`     – small metadata ([`KeyMeta`]).
//!
//! All writes are made under the keystore's lock (`.lock`), to temporary
//! files in the same directory that are fsynced, then renamed in one
//! recorded commit (`.NAME.commit`, see [`Keystore::save_locked`]), so a
//! crash never leaves a truncated key, nor one key's file beside another's
//! metadata.

use std::fs::{self, OpenOptions};
use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::keyfile::{KeyAlg, KeyBlob};
use crate::pcr::PcrSelection;
use crate::trust;

/// Environment variable overriding the keystore location.
pub const ENV_HOME: &str = "TPMCRYPT_HOME";

/// Metadata stored beside each key.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeyMeta {
    /// Key name (file stem).
    pub name: String,
    /// `rsa2048` or `ecc-p256`.
    pub alg: String,
    /// PCR binding such as `sha256:0,7`, if any.
    pub pcrs: Option<String>,
    /// Whether a PIN is required.
    pub has_pin: bool,
    /// Creation (or import) time, seconds since the Unix epoch.
    pub created: u64,
    /// Hex name of the SRK the key was created under (identifies the TPM).
    pub srk_name: Option<String>,
    /// Free-form TPM description (manufacturer, firmware) at creation time.
    pub tpm: Option<String>,
    /// True if the key was created on a software TPM (no real protection).
    #[serde(default)]
    pub simulator: bool,
    /// Recovery recipient strings every file for this key is also
    /// encrypted to (the CLI's `key create --recovery`).
    #[serde(default)]
    pub recovery: Vec<String>,
}

impl KeyMeta {
    /// Metadata for a freshly created key, filling alg/pcrs/has_pin from it.
    pub fn for_key(name: &str, blob: &KeyBlob) -> Result<KeyMeta> {
        Ok(KeyMeta {
            name: name.to_string(),
            alg: blob.alg()?.as_str().to_string(),
            pcrs: blob.pcr_policy()?.map(|(s, _)| s.to_string()),
            has_pin: !blob.empty_auth,
            created: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0),
            srk_name: None,
            tpm: None,
            simulator: false,
            recovery: Vec::new(),
        })
    }

    /// The algorithm as [`KeyAlg`].
    pub fn key_alg(&self) -> Result<KeyAlg> {
        KeyAlg::parse(&self.alg)
    }

    /// The PCR selection, if any.
    pub fn pcr_selection(&self) -> Result<Option<PcrSelection>> {
        self.pcrs.as_deref().map(PcrSelection::parse).transpose()
    }
}

/// A key directory.
#[derive(Debug, Clone)]
pub struct Keystore {
    dir: PathBuf,
}

/// Checks a key name: 1-64 chars of `[A-Za-z0-9._-]`, not starting with a
/// dot or dash (no hidden files, no option look-alikes, no path tricks).
pub fn validate_name(name: &str) -> Result<()> {
    let ok_chars = name
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'));
    if name.is_empty()
        || name.len() > 64
        || !ok_chars
        || name.starts_with('.')
        || name.starts_with('-')
    {
        return Err(Error::KeyName(format!(
            "invalid key name {name:?}: use 1-64 characters from A-Z a-z 0-9 . _ - \
             (not starting with '.' or '-')"
        )));
    }
    Ok(())
}

/// Refuses a relative `TPMCRYPT_HOME` (a space, a literal `~/keys` from a
/// unit file, which no shell expands): it would be a keystore relative to
/// each working directory, a new key made wherever a command ran. (A
/// relative HOME or XDG_DATA_HOME counts as unset; this one is named
/// explicitly, so it is an error.)
pub fn check_env_home(dir: &Path) -> Result<()> {
    if dir.is_absolute() {
        return Ok(());
    }
    Err(Error::Keystore(format!(
        "{ENV_HOME} is not an absolute path ({dir:?}): set it to one, or pass --keystore"
    )))
}

impl Keystore {
    /// The default location: `$TPMCRYPT_HOME`, else
    /// `$XDG_DATA_HOME/tpmcrypt` (if absolute), else
    /// `~/.local/share/tpmcrypt`.
    pub fn default_dir() -> Result<PathBuf> {
        let non_empty = |v: &str| std::env::var_os(v).filter(|s| !s.is_empty());
        if let Some(d) = non_empty(ENV_HOME) {
            let d = PathBuf::from(d);
            check_env_home(&d)?;
            return Ok(d);
        }
        if let Some(d) = crate::trust::env_dir("XDG_DATA_HOME") {
            return Ok(d.join("tpmcrypt"));
        }
        // A relative HOME (`.`, a literal `~` from a unit file) would give
        // each working directory a keystore of its own: as unset.
        if let Some(h) = crate::trust::env_dir("HOME") {
            return Ok(h.join(".local/share/tpmcrypt"));
        }
        let why = match non_empty("HOME") {
            Some(_) => "HOME is not an absolute path",
            None => "HOME is not set",
        };
        Err(Error::Keystore(format!(
            "cannot locate the keystore ({why}): set TPMCRYPT_HOME or HOME, or pass --keystore"
        )))
    }

    /// Opens a keystore directory. One that does not exist is not made
    /// here (a command that only reads, `key list`, `encrypt -k`, leaves
    /// the disk as it was): it holds no key, and the first save makes it,
    /// mode 0700 ([`Keystore::lock`]).
    pub fn open(dir: impl Into<PathBuf>) -> Result<Keystore> {
        let dir = dir.into();
        if fs::symlink_metadata(&dir).is_ok() && !dir.is_dir() {
            return Err(Error::Keystore(format!(
                "{} is not a directory",
                dir.display()
            )));
        }
        Ok(Keystore { dir })
    }

    /// Checks that nobody but the caller could have put or changed keys
    /// here: the directory is the caller's, not writable by others, under
    /// directories that are the caller's or root's (see [`crate::trust`]).
    /// A keystore not made yet holds nothing; where it would be made must
    /// be a place where nobody else could make it first.
    pub fn check_trusted(&self) -> Result<()> {
        if fs::symlink_metadata(&self.dir).is_err() {
            let (at, _) = trust::deepest_existing(&self.dir);
            return trust::check_dir_to_create_in(at);
        }
        trust::check_private_dir(&self.dir, "the keystore directory")
    }

    /// Opens the default keystore.
    pub fn open_default() -> Result<Keystore> {
        Keystore::open(Keystore::default_dir()?)
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Path of `NAME.key.pem`.
    pub fn key_path(&self, name: &str) -> PathBuf {
        self.dir.join(format!("{name}.key.pem"))
    }

    /// Path of `NAME.pub.pem`.
    pub fn pub_path(&self, name: &str) -> PathBuf {
        self.dir.join(format!("{name}.pub.pem"))
    }

    /// Path of `NAME.json`.
    pub fn meta_path(&self, name: &str) -> PathBuf {
        self.dir.join(format!("{name}.json"))
    }

    /// Whether a key with this name exists (or is being saved: a save cut
    /// short is finished by the next load or write).
    pub fn exists(&self, name: &str) -> bool {
        self.key_path(name).exists() || fs::symlink_metadata(self.commit_path(name)).is_ok()
    }

    /// Saves a key; fails if the name is taken unless `overwrite`. Takes
    /// the keystore's lock ([`Keystore::lock`]) for the check and the
    /// writes, so of two runs saving one name without `overwrite` exactly
    /// one succeeds, and no run's read-modify-write is undone by another.
    pub fn save(&self, name: &str, blob: &KeyBlob, meta: &KeyMeta, overwrite: bool) -> Result<()> {
        let lock = self.lock()?;
        self.save_locked(&lock, name, blob, meta, overwrite)
    }

    /// [`Keystore::save`] under a lock the caller holds (a read-modify-write).
    ///
    /// A key is three files, and a crash between their renames must not
    /// leave one key's file beside another's metadata (its recovery
    /// recipients, its PIN flag). So the three are written under temporary
    /// names and made durable, then a commit record naming them is made
    /// durable, then they are renamed into place and the record removed.
    /// A record found later (by [`Keystore::lock`], or by a
    /// [`Keystore::load`] of that name) is finished: the renames it names
    /// that were not done are done. Without a record, temporaries are
    /// left-overs of a run that never committed, and are removed.
    pub fn save_locked(
        &self,
        _lock: &KeystoreLock,
        name: &str,
        blob: &KeyBlob,
        meta: &KeyMeta,
        overwrite: bool,
    ) -> Result<()> {
        validate_name(name)?;
        if !overwrite && self.exists(name) {
            return Err(Error::Keystore(format!(
                "a key named '{name}' already exists in {}",
                self.dir.display()
            )));
        }
        let mut meta = meta.clone();
        meta.name = name.to_string();
        let json = serde_json::to_string_pretty(&meta)
            .map_err(|e| Error::Keystore(format!("metadata: {e}")))?;
        let pub_pem = blob.public_key_pem()?;
        let mut renames = Vec::with_capacity(3);
        let written = (|| -> Result<()> {
            // Metadata and public key first: the key file's presence is
            // what makes the key "exist", so it is renamed last.
            for (target, data, mode) in [
                (self.meta_path(name), json.into_bytes(), 0o600),
                (self.pub_path(name), pub_pem.into_bytes(), 0o644),
                (self.key_path(name), blob.to_pem().into_bytes(), 0o600),
            ] {
                let tmp = write_temporary(&target, &data, mode)?;
                renames.push((file_name_of(&tmp)?, file_name_of(&target)?));
            }
            let record = serde_json::to_vec(&CommitRecord {
                renames: renames.clone(),
            })
            .map_err(|e| Error::Keystore(format!("commit record: {e}")))?;
            atomic_write(&self.commit_path(name), &record, 0o600)
        })();
        if let Err(e) = written {
            for (tmp, _) in &renames {
                let _ = fs::remove_file(self.dir.join(tmp));
            }
            return Err(e);
        }
        self.finish_commit(name, &renames)
    }

    /// `.NAME.commit`: the record of a save under way.
    fn commit_path(&self, name: &str) -> PathBuf {
        self.dir.join(format!(".{name}.commit"))
    }

    /// Does the renames a commit record names (those not done yet), makes
    /// them durable, then removes the record.
    fn finish_commit(&self, name: &str, renames: &[(String, String)]) -> Result<()> {
        for (tmp, target) in renames {
            let (from, to) = (self.dir.join(tmp), self.dir.join(target));
            match fs::rename(&from, &to) {
                Ok(()) => {}
                // Done before a crash: the record outlived it.
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(Error::io(&to, e)),
            }
        }
        sync_dir(&self.dir)?;
        let record = self.commit_path(name);
        remove_files(&[record])?;
        sync_dir(&self.dir)
    }

    /// Finishes the save `.NAME.commit` records, if one is there (a run
    /// killed, or a machine that lost power, between the renames).
    fn finish_recorded(&self, name: &str) -> Result<()> {
        let path = self.commit_path(name);
        let bytes = match trust::read_private_file(&path, "a key's commit record") {
            Ok(b) => b,
            Err(Error::Io { error, .. }) if error.kind() == std::io::ErrorKind::NotFound => {
                return Ok(())
            }
            Err(e) => return Err(e),
        };
        let damaged = || {
            Error::Keystore(format!(
                "{}: a damaged record of a key being saved (the key's files are as the \
                 interrupted save left them); remove it to use them as they are",
                path.display()
            ))
        };
        let record: CommitRecord = serde_json::from_slice(&bytes).map_err(|_| damaged())?;
        // Only this key's three names, and temporaries of them beside them.
        let targets = [
            file_name_of(&self.meta_path(name))?,
            file_name_of(&self.pub_path(name))?,
            file_name_of(&self.key_path(name))?,
        ];
        // A temporary still to rename must be a regular file of the
        // keystore's owner: never a symlink renamed over a key file.
        // SAFETY: geteuid cannot fail.
        let me = unsafe { libc::geteuid() };
        let ours = |tmp: &str| match fs::symlink_metadata(self.dir.join(tmp)) {
            Ok(m) => m.is_file() && std::os::unix::fs::MetadataExt::uid(&m) == me,
            Err(e) => e.kind() == std::io::ErrorKind::NotFound,
        };
        let sound = record.renames.iter().all(|(tmp, target)| {
            targets.contains(target)
                && tmp
                    .strip_prefix('.')
                    .is_some_and(|t| t.starts_with(target.as_str()))
                && is_temporary(tmp)
                && ours(tmp)
        });
        if !sound {
            return Err(damaged());
        }
        self.finish_commit(name, &record.renames)
    }

    /// Loads a key and its metadata.  Missing metadata (e.g. files copied in
    /// by hand) is reconstructed from the key file.
    pub fn load(&self, name: &str) -> Result<(KeyBlob, KeyMeta)> {
        self.load_with_public(name)
            .map(|(blob, meta, _)| (blob, meta))
    }

    /// [`Keystore::load`], and `NAME.pub.pem` if it exists, all three read
    /// as one version: under a shared lock, so a save under way (which
    /// holds the lock) is waited for, never seen half done. A save that
    /// was cut short is finished first.
    pub fn load_with_public(&self, name: &str) -> Result<(KeyBlob, KeyMeta, Option<Vec<u8>>)> {
        validate_name(name)?;
        if fs::symlink_metadata(self.commit_path(name)).is_ok() {
            drop(self.lock().map_err(|e| self.pending(name, e))?);
        }
        let _shared = self.shared_lock()?;
        self.read_key(name)
    }

    /// [`Keystore::load`] by a caller holding the lock (which
    /// [`Keystore::lock`] has tidied: no save is pending).
    pub fn load_locked(&self, _lock: &KeystoreLock, name: &str) -> Result<(KeyBlob, KeyMeta)> {
        validate_name(name)?;
        self.read_key(name).map(|(blob, meta, _)| (blob, meta))
    }

    /// The error for a save of `name` left pending that this run cannot
    /// finish (a keystore it may not write, a damaged record).
    fn pending(&self, name: &str, cause: Error) -> Error {
        Error::Keystore(format!(
            "a save of key '{name}' was cut short and cannot be finished ({cause}); run a \
             `tpmcrypt key` command as the keystore's owner, with {} writable",
            self.dir.display()
        ))
    }

    fn read_key(&self, name: &str) -> Result<(KeyBlob, KeyMeta, Option<Vec<u8>>)> {
        let path = self.key_path(name);
        // The key file and its metadata (which lists recovery recipients
        // every file for the key is also encrypted to) must be the user's,
        // regular files of a key file's size (checked as they are read).
        let not_found = |e: &Error| matches!(e, Error::Io { error, .. } if error.kind() == std::io::ErrorKind::NotFound);
        let pem = match trust::read_private_file(&path, "the key file") {
            Ok(bytes) => bytes,
            Err(e) if not_found(&e) => {
                return Err(Error::KeyName(format!(
                    "no key named '{name}' in {}",
                    self.dir.display()
                )))
            }
            Err(e) => return Err(e),
        };
        let pem = String::from_utf8(pem).map_err(|_| {
            Error::Keystore(format!("{}: not a PEM key file (not text)", path.display()))
        })?;
        let blob = KeyBlob::from_pem(&pem)
            .map_err(|e| Error::Keystore(format!("{}: {e}", path.display())))?;
        let meta_path = self.meta_path(name);
        let meta = match trust::read_private_file(&meta_path, "the key's metadata file") {
            Ok(bytes) => serde_json::from_slice(&bytes)
                .map_err(|e| Error::Keystore(format!("{}: {e}", meta_path.display())))?,
            Err(e) if not_found(&e) => KeyMeta::for_key(name, &blob)?,
            Err(e) => return Err(e),
        };
        let public = self.public_pem(name)?;
        Ok((blob, meta, public))
    }

    /// The public key of `name` as a SubjectPublicKeyInfo (DER), taken
    /// from the key file itself. `NAME.pub.pem`, a copy for other tools, is
    /// compared with it: a copy that differs (replaced by something other
    /// than tpmcrypt) is refused rather than trusted or ignored.
    pub fn public_key_der(&self, name: &str) -> Result<(Vec<u8>, KeyMeta)> {
        let (blob, meta, public) = self.load_with_public(name)?;
        let der = blob.public_key_der()?;
        if let Some(pem) = public {
            let theirs = openssl::pkey::PKey::public_key_from_pem(&pem)
                .and_then(|k| k.public_key_to_der())
                .ok();
            if theirs.as_deref() != Some(&der[..]) {
                return Err(Error::Untrusted {
                    path: self.pub_path(name),
                    why: format!(
                        "does not hold the public half of {name}.key.pem (changed by \
                         something other than tpmcrypt); refusing to encrypt to it. \
                         `tpmcrypt key export {name}` prints the key's real public half"
                    ),
                });
            }
        }
        Ok((der, meta))
    }

    /// The contents of `NAME.pub.pem`, checked as key files are, if it
    /// exists.
    pub fn public_pem(&self, name: &str) -> Result<Option<Vec<u8>>> {
        match trust::read_private_file(&self.pub_path(name), "the public key file") {
            Ok(pem) => Ok(Some(pem)),
            Err(Error::Io { error, .. }) if error.kind() == std::io::ErrorKind::NotFound => {
                Ok(None)
            }
            Err(e) => Err(e),
        }
    }

    /// Names of all keys, sorted.
    pub fn list(&self) -> Result<Vec<String>> {
        let mut names = Vec::new();
        let rd = match fs::read_dir(&self.dir) {
            Ok(rd) => rd,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(names),
            Err(e) => return Err(Error::io(&self.dir, e)),
        };
        for entry in rd {
            let entry = entry.map_err(|e| Error::io(&self.dir, e))?;
            let file = entry.file_name();
            if let Some(name) = file.to_str().and_then(|f| f.strip_suffix(".key.pem")) {
                if validate_name(name).is_ok() {
                    names.push(name.to_string());
                }
            }
        }
        names.sort();
        Ok(names)
    }

    /// Deletes a key's files, under the keystore's lock. The key file goes
    /// first so a partial delete never leaves a usable key without its
    /// metadata; a delete cut short after it (the other two left, the key
    /// invisible) is finished by deleting the name again.
    pub fn delete(&self, name: &str) -> Result<()> {
        validate_name(name)?;
        let _lock = self.lock()?;
        let paths = [
            self.key_path(name),
            self.pub_path(name),
            self.meta_path(name),
        ];
        if !paths.iter().any(|p| fs::symlink_metadata(p).is_ok()) {
            return Err(Error::KeyName(format!("no key named '{name}'")));
        }
        remove_files(&paths)?;
        sync_dir(&self.dir)
    }

    /// Deletes the files a delete cut short left of `name` (its metadata,
    /// its public key), under the lock. If the key turns out to exist once
    /// the lock is held (a save that was under way, or cut short and now
    /// finished), nothing is deleted: that is a key, for `delete` after a
    /// confirmation.
    pub fn delete_leftovers(&self, name: &str) -> Result<()> {
        validate_name(name)?;
        let _lock = self.lock()?;
        if self.key_path(name).exists() {
            return Err(Error::Keystore(format!(
                "key '{name}' exists (a save of it was under way or cut short, and is \
                 finished); deleting it needs a confirmation"
            )));
        }
        remove_files(&[self.pub_path(name), self.meta_path(name)])?;
        sync_dir(&self.dir)
    }

    /// Whether `name` has files left by a delete that was cut short (its
    /// key file gone, its metadata or public key still there).
    pub fn has_leftovers(&self, name: &str) -> bool {
        !self.exists(name)
            && (fs::symlink_metadata(self.pub_path(name)).is_ok()
                || fs::symlink_metadata(self.meta_path(name)).is_ok())
    }

    /// Imports a `TSS2 PRIVATE KEY` PEM (e.g. written by
    /// `tpm2_encodeobject`).
    ///
    /// `has_pin` overrides the file's emptyAuth flag: tpm2-tools 5.4's
    /// `tpm2_encodeobject` writes it inverted (emptyAuth=FALSE unless `-p`
    /// is given), so for such files callers should say what they know.
    /// `None` trusts the file.
    pub fn import(
        &self,
        name: &str,
        pem_path: &Path,
        has_pin: Option<bool>,
    ) -> Result<(KeyBlob, KeyMeta)> {
        let pem = fs::read_to_string(pem_path).map_err(|e| Error::io(pem_path, e))?;
        self.import_checked(name, &pem, has_pin, |_| Ok(()))
    }

    /// As [`Keystore::import`], with `check` run on the parsed key before
    /// anything is saved (the CLI checks there that the TPM loads it).
    /// The key is given as the PEM text the caller read (once: a file
    /// read twice may have changed, and a pipe has nothing left).
    pub fn import_checked(
        &self,
        name: &str,
        pem: &str,
        has_pin: Option<bool>,
        check: impl FnOnce(&KeyBlob) -> Result<()>,
    ) -> Result<(KeyBlob, KeyMeta)> {
        validate_name(name)?;
        let mut blob = KeyBlob::from_pem(pem)?;
        check(&blob)?;
        if let Some(p) = has_pin {
            blob.empty_auth = !p;
        }
        let meta = KeyMeta::for_key(name, &blob)?;
        self.save(name, &blob, &meta, false)?;
        Ok((blob, meta))
    }
}

/// Called (once a process) when a keystore's lock is held by another
/// process and this one is about to wait for it: see [`on_lock_wait`].
/// Whether this process said it waits for a keystore's lock.
static LOCK_WAIT_SAID: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// An exclusive lock on a keystore ([`Keystore::lock`]), released when
/// dropped.
#[derive(Debug)]
pub struct KeystoreLock(#[allow(dead_code)] fs::File);

impl Keystore {
    /// Takes an exclusive lock on the keystore, waiting for another
    /// holder: every write of a key's files is done under it, so a
    /// read-modify-write (`key add-policy`) loses no concurrent change and
    /// a name is taken by one run only. Once taken, saves cut short are
    /// finished and temporaries no save will commit are removed
    /// ([`Keystore::save_locked`]). The lock is `flock` on
    /// `.lock`, a file of the keystore's owner, mode 0600: a directory
    /// that others may read (trusted: not writable by them) would let
    /// another user hold its lock for ever.
    pub fn lock(&self) -> Result<KeystoreLock> {
        // The first write makes the keystore (see [`Keystore::open`]).
        if fs::symlink_metadata(&self.dir).is_err() {
            self.check_trusted()?;
            fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(&self.dir)
                .map_err(|e| Error::io(&self.dir, e))?;
        }
        // Checked as it is now, by every write: a check made at the start
        // of the run says nothing of a keystore that something else made
        // since (another user, while the run asked for a PIN).
        self.check_trusted()?;
        let Some(lock) = self.lock_file(true)? else {
            return Err(Error::Keystore(format!(
                "no lock file in {}",
                self.dir.display()
            )));
        };
        self.tidy(&lock)?;
        Ok(lock)
    }

    /// A shared lock for reading a key's files as one version; `None` where
    /// no lock file exists and none can be made (a keystore this run may
    /// not write, which no save can change either).
    fn shared_lock(&self) -> Result<Option<KeystoreLock>> {
        if fs::symlink_metadata(&self.dir).is_err() {
            // Not made yet: nothing to read, and no lock file made for it.
            return Ok(None);
        }
        self.lock_file(false)
    }

    /// [`Keystore::lock_file_once`] until the lock taken is on the file
    /// the name `.lock` gives: one removed or replaced after this run
    /// opened it (while it waited for another process) would stand
    /// between this run and no process that opens the file the name now
    /// gives.
    fn lock_file(&self, exclusive: bool) -> Result<Option<KeystoreLock>> {
        let path = self.dir.join(".lock");
        loop {
            match self.lock_file_once(exclusive)? {
                Some(lock) if !trust::still_names(&path, &lock.0) => continue,
                taken => return Ok(taken),
            }
        }
    }

    fn lock_file_once(&self, exclusive: bool) -> Result<Option<KeystoreLock>> {
        use std::os::unix::io::AsRawFd;
        let path = self.dir.join(".lock");
        let open = |write: bool| {
            OpenOptions::new()
                .read(true)
                .write(write)
                .create(write)
                .truncate(false)
                .mode(0o600)
                .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
                .open(&path)
        };
        // A reader opens the lock file to read (an flock needs no more),
        // and makes it only where it is missing.
        let file = match exclusive {
            true => open(true),
            false => match open(false) {
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => open(true),
                other => other,
            },
        };
        let file = match file {
            Ok(f) => f,
            // No lock file, and none can be made here: nor can a save.
            Err(e)
                if !exclusive
                    && matches!(
                        e.raw_os_error(),
                        Some(libc::EACCES | libc::EROFS | libc::EPERM)
                    )
                    && fs::symlink_metadata(&path).is_err() =>
            {
                return Ok(None)
            }
            Err(e) if e.raw_os_error() == Some(libc::ELOOP) => {
                return Err(Error::Keystore(format!(
                    "{} is a symbolic link, not the keystore's lock file",
                    path.display()
                )))
            }
            Err(e) => return Err(Error::io(&path, e)),
        };
        let meta = file.metadata().map_err(|e| Error::io(&path, e))?;
        if !meta.is_file() {
            return Err(Error::Keystore(format!(
                "{} is not a regular file",
                path.display()
            )));
        }
        trust::check_owned(&path, &meta, "the keystore's lock file")?;
        if exclusive {
            file.set_permissions(fs::Permissions::from_mode(0o600))
                .map_err(|e| Error::io(&path, e))?;
        }
        let how = if exclusive {
            libc::LOCK_EX
        } else {
            libc::LOCK_SH
        };
        if trust::try_flock(&file, how).map_err(|e| Error::io(&path, e))? {
            return Ok(Some(KeystoreLock(file)));
        }
        // Held by another process: said (once a process), then waited for.
        trust::say_lock_wait(&LOCK_WAIT_SAID, &path, "the keystore's lock");
        loop {
            // SAFETY: flock on a descriptor this function owns.
            if unsafe { libc::flock(file.as_raw_fd(), how) } == 0 {
                return Ok(Some(KeystoreLock(file)));
            }
            let e = std::io::Error::last_os_error();
            if e.kind() != std::io::ErrorKind::Interrupted {
                return Err(Error::io(&path, e));
            }
        }
    }
}

impl Keystore {
    /// With the lock held: finishes every recorded save, then removes the
    /// temporaries left by runs killed before they recorded theirs (no
    /// other run is writing: writers hold the lock).
    fn tidy(&self, _lock: &KeystoreLock) -> Result<()> {
        let names = |dir: &Path| -> Result<Vec<String>> {
            let rd = fs::read_dir(dir).map_err(|e| Error::io(dir, e))?;
            Ok(rd
                .filter_map(|e| e.ok())
                .filter_map(|e| e.file_name().into_string().ok())
                .collect())
        };
        for file in names(&self.dir)? {
            if let Some(name) = file
                .strip_prefix('.')
                .and_then(|f| f.strip_suffix(".commit"))
            {
                if validate_name(name).is_ok() {
                    self.finish_recorded(name)?;
                }
            }
        }
        let mut removed = false;
        for file in names(&self.dir)? {
            if file.starts_with('.') && is_temporary(&file) {
                let path = self.dir.join(&file);
                // Only a regular file of the keystore's owner (the
                // directory is trusted: nobody else may write in it).
                let regular = fs::symlink_metadata(&path).is_ok_and(|m| m.is_file());
                if regular && fs::remove_file(&path).is_ok() {
                    removed = true;
                }
            }
        }
        if removed {
            sync_dir(&self.dir)?;
        }
        Ok(())
    }
}

/// What a save is about to rename: (temporary, final name), file names in
/// the keystore directory.
#[derive(Serialize, Deserialize)]
struct CommitRecord {
    renames: Vec<(String, String)>,
}

/// Whether `file` is named as [`write_temporary`] names its files:
/// `.NAME….tmpPID.RANDOM` (16 hex digits).
fn is_temporary(file: &str) -> bool {
    let Some((head, random)) = file.rsplit_once('.') else {
        return false;
    };
    let Some((_, pid)) = head.rsplit_once(".tmp") else {
        return false;
    };
    random.len() == 16
        && random.bytes().all(|b| b.is_ascii_hexdigit())
        && !pid.is_empty()
        && pid.bytes().all(|b| b.is_ascii_digit())
}

/// Removes each of `paths` that is there, in order.
fn remove_files(paths: &[PathBuf]) -> Result<()> {
    for p in paths {
        match fs::remove_file(p) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(Error::io(p, e)),
        }
    }
    Ok(())
}

fn file_name_of(path: &Path) -> Result<String> {
    path.file_name()
        .and_then(|f| f.to_str())
        .map(str::to_string)
        .ok_or_else(|| Error::Keystore(format!("bad path {}", path.display())))
}

fn sync_dir(dir: &Path) -> Result<()> {
    fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| Error::io(dir, e))
}

// Written here rather than shared with the CLI's `AtomicFile`: that one
// lives above this crate and carries what a bulk run needs (group commit,
// owner and mode kept); a key file is small, written rarely, one at a time.

/// Writes `data` beside `path` under a temporary name
/// (`.NAME.tmpPID.RANDOM`, a new file of exactly `mode`), fsynced, and
/// returns that name.
fn write_temporary(path: &Path, data: &[u8], mode: u32) -> Result<PathBuf> {
    let dir = path.parent().unwrap_or_else(|| Path::new("."));
    let file_name = file_name_of(path)?;
    // A random part too: a run killed before its rename leaves its
    // temporary, and PIDs repeat (a service in its own PID namespace is
    // PID 1 every time), so a PID alone would collide with it for ever.
    let mut random = [0u8; 8];
    openssl::rand::rand_bytes(&mut random)
        .map_err(|e| Error::Keystore(format!("no random bytes: {e}")))?;
    let tmp = dir.join(format!(
        ".{file_name}.tmp{}.{}",
        std::process::id(),
        hex::encode(random)
    ));
    let result = (|| -> std::io::Result<()> {
        let mut f = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(mode)
            .open(&tmp)?;
        // The umask may have narrowed the mode; make it exact.
        f.set_permissions(fs::Permissions::from_mode(mode))?;
        f.write_all(data)?;
        f.sync_all()
    })();
    match result {
        Ok(()) => Ok(tmp),
        Err(e) => {
            let _ = fs::remove_file(&tmp);
            Err(Error::io(path, e))
        }
    }
}

/// Writes `data` to `path` atomically with the given mode: a temporary
/// ([`write_temporary`]) renamed over `path`, its directory fsynced.
fn atomic_write(path: &Path, data: &[u8], mode: u32) -> Result<()> {
    let tmp = write_temporary(path, data, mode)?;
    if let Err(e) = fs::rename(&tmp, path) {
        let _ = fs::remove_file(&tmp);
        return Err(Error::io(path, e));
    }
    sync_dir(path.parent().unwrap_or_else(|| Path::new(".")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_names_of_temporaries_are_taken_for_them() {
        for t in [
            ".k.json.tmp12.0123456789abcdef",
            ".k.1.key.pem.tmp1.ffffffffffffffff",
            ".k.commit.tmp99.0000000000000000",
        ] {
            assert!(is_temporary(t), "{t}");
        }
        for f in [
            "k.key.pem",
            ".lock",
            ".k.commit",
            ".k.json.tmp.0123456789abcdef",
            ".k.json.tmp12.0123456789abcde",
            ".k.json.tmp12.0123456789abcdeg",
            ".k.json.tmpx2.0123456789abcdef",
        ] {
            assert!(!is_temporary(f), "{f}");
        }
    }

    #[test]
    fn names() {
        for ok in ["a", "work-key", "k.1", "A_b-9"] {
            validate_name(ok).unwrap();
        }
        for bad in [
            "",
            ".hidden",
            "-x",
            "a/b",
            "..",
            "a b",
            "ä",
            &"x".repeat(65),
        ] {
            assert!(validate_name(bad).is_err(), "{bad}");
        }
    }
}
