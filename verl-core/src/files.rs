//! Reading files a user names (configs, data, tokenizers, checkpoint metadata, traces) with
//! bounds: only regular files (a FIFO, a device such as `/dev/zero` or a directory would hang
//! the reader or fill memory), and at most a limit of bytes for the kinds whose size is
//! bounded by nature. The errors are `std::io::Error`s (kind `InvalidInput`), so each caller
//! names the path as it names any other read failure.

use std::io::{Error, ErrorKind, Read};
use std::path::Path;

/// Configs, JSON metadata, tokenizer and chat-template files: none is legitimately larger.
pub const TEXT_LIMIT: u64 = 256 << 20;

/// `path`'s bytes, if it is a regular file (symlinks followed) of at most `limit` bytes.
///
/// ```
/// use verl_core::files::read_regular;
/// let dir = std::env::temp_dir().join(format!("verl-files-doc-{}", std::process::id()));
/// std::fs::create_dir_all(&dir)?;
/// std::fs::write(dir.join("a.yaml"), "x: 1\n")?;
/// assert_eq!(read_regular(&dir.join("a.yaml"), 1024)?, b"x: 1\n");
/// // A directory, a device or a FIFO is refused instead of read.
/// assert!(read_regular(&dir, 1024).is_err());
/// // So is a file over the limit.
/// assert!(read_regular(&dir.join("a.yaml"), 2).is_err());
/// # std::fs::remove_dir_all(&dir)?;
/// # Ok::<(), std::io::Error>(())
/// ```
pub fn read_regular(path: &Path, limit: u64) -> std::io::Result<Vec<u8>> {
    let mut file = open_regular(path)?;
    let len = file.metadata()?.len();
    if len > limit {
        return Err(over(len, limit));
    }
    let mut bytes = Vec::with_capacity(len as usize);
    // A file that grows while read stops at the limit too.
    (&mut file)
        .take(limit.saturating_add(1))
        .read_to_end(&mut bytes)?;
    if bytes.len() as u64 > limit {
        return Err(over(bytes.len() as u64, limit));
    }
    Ok(bytes)
}

/// A text file a user names (a config, JSON metadata, a tokenizer, a chat template): a regular
/// file of at most [`TEXT_LIMIT`] bytes, as UTF-8.
pub fn read_text(path: &Path) -> std::io::Result<String> {
    String::from_utf8(read_regular(path, TEXT_LIMIT)?)
        .map_err(|e| Error::new(ErrorKind::InvalidData, format!("not UTF-8 text: {e}")))
}

/// `path` opened for reading, if it is a regular file (its size unbounded: data files and
/// checkpoints are read by streaming readers).
pub fn open_regular(path: &Path) -> std::io::Result<std::fs::File> {
    let meta = std::fs::metadata(path)?;
    if !meta.is_file() {
        let kind = if meta.is_dir() {
            "a directory"
        } else {
            "not a regular file (a FIFO, socket or device)"
        };
        return Err(Error::new(
            ErrorKind::InvalidInput,
            format!("{kind}; name a regular file"),
        ));
    }
    std::fs::File::open(path)
}

fn over(len: u64, limit: u64) -> Error {
    Error::new(
        ErrorKind::InvalidInput,
        format!("{len} bytes, over the {limit}-byte limit for this kind of file"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn devices_fifos_and_directories_are_refused_without_reading() {
        let dir = tempfile::tempdir().unwrap();
        for path in [
            Path::new("/dev/zero"),
            Path::new("/dev/urandom"),
            dir.path(),
        ] {
            let e = read_regular(path, TEXT_LIMIT).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::InvalidInput, "{path:?}");
            assert!(open_regular(path).is_err(), "{path:?}");
        }
        let fifo = dir.path().join("fifo");
        let made = std::process::Command::new("mkfifo").arg(&fifo).status();
        if made.is_ok_and(|s| s.success()) {
            // Opening a FIFO for reading would block until a writer comes: it is never opened.
            let e = read_regular(&fifo, TEXT_LIMIT).unwrap_err();
            assert!(e.to_string().contains("FIFO"), "{e}");
        }
    }

    #[test]
    fn the_limit_is_exact() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("f");
        std::fs::write(&p, [7u8; 100]).unwrap();
        assert_eq!(read_regular(&p, 100).unwrap().len(), 100);
        // No bound at all (data files) is u64::MAX.
        assert_eq!(read_regular(&p, u64::MAX).unwrap().len(), 100);
        let e = read_regular(&p, 99).unwrap_err();
        assert!(
            e.to_string().contains("100 bytes, over the 99-byte limit"),
            "{e}"
        );
        // Symlinks are followed to the file they name.
        let link = dir.path().join("l");
        std::os::unix::fs::symlink(&p, &link).unwrap();
        assert_eq!(read_regular(&link, 100).unwrap().len(), 100);
    }
}
