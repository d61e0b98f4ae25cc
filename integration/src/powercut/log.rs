//! The dm-log-writes log format, read back and replayed onto a disk image.
//!
//! The format, as the kernel's `dm-log-writes` target and QEMU's
//! `blklogwrites` block driver both write it (all fields little-endian):
//!
//! - sector 0: the super block, `magic: u64`, `version: u64`,
//!   `nr_entries: u64`, `sectorsize: u32`; rewritten on every flush, so
//!   `nr_entries` counts the entries up to the last flush;
//! - then, one after the other, each entry: one log sector starting with
//!   `sector: u64`, `nr_sectors: u64`, `flags: u64`, `data_len: u64` (a
//!   mark's text follows the header in that sector), followed by the
//!   `nr_sectors` sectors of data the write carried (none for a discard).
//!
//! Only 512-byte log sectors are read (the harness sets
//! `log-sector-size=512`): there, the kernel (which counts `sector` and
//! `nr_sectors` in 512-byte units) and QEMU (which counts them in log
//! sectors) agree.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::FileExt;
use std::path::Path;

/// The super block's magic number.
pub const LOG_MAGIC: u64 = 0x006a_7366_7773_6872;
/// The only log version there is.
pub const LOG_VERSION: u64 = 1;
/// The write is a cache flush (with or without data): everything written
/// before it is durable once it completes.
pub const FLAG_FLUSH: u64 = 1 << 0;
/// The write went to stable storage before it completed (forced unit access).
pub const FLAG_FUA: u64 = 1 << 1;
/// A discard of the range: no data follows.
pub const FLAG_DISCARD: u64 = 1 << 2;
/// A mark (a label written by `dmsetup message`): no data follows.
pub const FLAG_MARK: u64 = 1 << 3;
/// The kernel's hint that a write is metadata (dm-log-writes only).
pub const FLAG_METADATA: u64 = 1 << 4;
const KNOWN_FLAGS: u64 = FLAG_FLUSH | FLAG_FUA | FLAG_DISCARD | FLAG_MARK | FLAG_METADATA;
/// The only log sector size this reader takes.
pub const SECTOR: u64 = 512;
const HEADER: usize = 32;

/// One logged request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LogEntry {
    /// Its position in the log, from 0.
    pub index: usize,
    /// First sector written (512-byte units).
    pub sector: u64,
    /// Sectors written (0 for a bare flush).
    pub nr_sectors: u64,
    /// `FLAG_*` bits.
    pub flags: u64,
    /// Bytes of mark text (marks only).
    pub data_len: u64,
    /// Where its data starts in the log file, in bytes.
    pub data_offset: u64,
}

impl LogEntry {
    /// Whether this is a flush or a FUA write: a point up to which the
    /// disk must hold every completed write.
    pub fn is_barrier(&self) -> bool {
        self.flags & (FLAG_FLUSH | FLAG_FUA) != 0
    }

    /// Whether this entry carries data to write.
    pub fn has_data(&self) -> bool {
        self.nr_sectors > 0 && self.flags & (FLAG_DISCARD | FLAG_MARK) == 0
    }
}

/// A parsed log: its entries, with their data left in the file.
#[derive(Debug)]
pub struct WriteLog {
    file: File,
    /// Every entry, in log order.
    pub entries: Vec<LogEntry>,
    /// How many entries the super block counts (those up to the last
    /// flush); entries past it were logged after the last flush.
    pub flushed_entries: usize,
}

fn le64(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(a)
}

fn bad(what: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, what)
}

impl WriteLog {
    /// Reads the log at `path`: the super block, then every entry the
    /// file holds, past `nr_entries` too (up to the end of the file, or a
    /// header of zeroes, which no writer logs). An entry whose flags are
    /// unknown or whose data runs past the end is an error.
    pub fn open(path: &Path) -> io::Result<WriteLog> {
        let file = File::open(path)
            .map_err(|e| io::Error::new(e.kind(), format!("{}: {e}", path.display())))?;
        let len = file.metadata()?.len();
        let mut sb = [0u8; 28];
        file.read_exact_at(&mut sb, 0)
            .map_err(|e| bad(format!("{}: no log super block ({e})", path.display())))?;
        let magic = le64(&sb, 0);
        if magic != LOG_MAGIC {
            return Err(bad(format!(
                "{}: bad log magic {magic:#x}, expected {LOG_MAGIC:#x}",
                path.display()
            )));
        }
        let version = le64(&sb, 8);
        if version != LOG_VERSION {
            return Err(bad(format!(
                "{}: log version {version}, only {LOG_VERSION} is known",
                path.display()
            )));
        }
        let nr_entries = le64(&sb, 16);
        let sectorsize = u32::from_le_bytes([sb[24], sb[25], sb[26], sb[27]]);
        if u64::from(sectorsize) != SECTOR {
            return Err(bad(format!(
                "{}: log sector size {sectorsize}, only {SECTOR} is read",
                path.display()
            )));
        }
        let flushed_entries = usize::try_from(nr_entries)
            .map_err(|_| bad(format!("{}: {nr_entries} entries", path.display())))?;
        let mut entries = Vec::with_capacity(flushed_entries);
        let mut at = SECTOR;
        let mut header = [0u8; HEADER];
        while at + SECTOR <= len {
            file.read_exact_at(&mut header, at)?;
            if entries.len() >= flushed_entries && header.iter().all(|&b| b == 0) {
                break;
            }
            let entry = LogEntry {
                index: entries.len(),
                sector: le64(&header, 0),
                nr_sectors: le64(&header, 8),
                flags: le64(&header, 16),
                data_len: le64(&header, 24),
                data_offset: at + SECTOR,
            };
            if entry.flags & !KNOWN_FLAGS != 0 {
                return Err(bad(format!(
                    "{}: entry {} at byte {at} has unknown flags {:#x}",
                    path.display(),
                    entry.index,
                    entry.flags
                )));
            }
            let data = if entry.flags & (FLAG_DISCARD | FLAG_MARK) != 0 {
                0
            } else {
                entry.nr_sectors
            };
            let end = data
                .checked_mul(SECTOR)
                .and_then(|d| d.checked_add(entry.data_offset))
                .filter(|&end| end <= len)
                .ok_or_else(|| {
                    bad(format!(
                        "{}: entry {} at byte {at} ({} sectors) runs past the end ({len} bytes)",
                        path.display(),
                        entry.index,
                        entry.nr_sectors
                    ))
                })?;
            entries.push(entry);
            at = end;
        }
        if entries.len() < flushed_entries {
            return Err(bad(format!(
                "{}: the super block counts {flushed_entries} entries, the file holds {}",
                path.display(),
                entries.len()
            )));
        }
        Ok(WriteLog {
            file,
            entries,
            flushed_entries,
        })
    }

    /// Indices of the flush and FUA entries: the state "before the i-th
    /// barrier" is the prefix of the log before that index.
    pub fn barriers(&self) -> Vec<usize> {
        self.entries
            .iter()
            .filter(|e| e.is_barrier())
            .map(|e| e.index)
            .collect()
    }

    /// Entries of each kind: (writes with data, flushes or FUA, discards,
    /// marks).
    pub fn counts(&self) -> (usize, usize, usize, usize) {
        let n = |f: &dyn Fn(&LogEntry) -> bool| self.entries.iter().filter(|e| f(e)).count();
        (
            n(&|e| e.has_data()),
            n(&|e| e.is_barrier()),
            n(&|e| e.flags & FLAG_DISCARD != 0),
            n(&|e| e.flags & FLAG_MARK != 0),
        )
    }

    /// Reads the data of `entry` into `buf` (resized to fit).
    fn read_data(&self, entry: &LogEntry, buf: &mut Vec<u8>) -> io::Result<()> {
        let len = usize::try_from(entry.nr_sectors * SECTOR)
            .map_err(|_| bad(format!("entry {} is too large", entry.index)))?;
        buf.resize(len, 0);
        self.file.read_exact_at(buf, entry.data_offset)
    }
}

/// A disk image being rebuilt from a base image and a log, entry by entry.
pub struct Replayer<'a> {
    log: &'a WriteLog,
    image: File,
    next: usize,
    buf: Vec<u8>,
}

impl<'a> Replayer<'a> {
    /// Starts a replay into `target`, a fresh copy of `base` (the disk as
    /// it was before the logged run).
    pub fn new(log: &'a WriteLog, base: &Path, target: &Path) -> io::Result<Replayer<'a>> {
        sparse_copy(base, target)?;
        let image = OpenOptions::new().read(true).write(true).open(target)?;
        Ok(Replayer {
            log,
            image,
            next: 0,
            buf: Vec::new(),
        })
    }

    /// How many entries have been applied.
    pub fn applied(&self) -> usize {
        self.next
    }

    /// Applies entries up to, not including, `end`, so the image is the
    /// disk as it stood before entry `end` reached it. Only forwards.
    ///
    /// A discard is an error: the harness runs with discards off and does
    /// not model what a device does with one.
    pub fn advance_to(&mut self, end: usize) -> io::Result<()> {
        let end = end.min(self.log.entries.len());
        while self.next < end {
            let entry = self.log.entries[self.next];
            if entry.flags & FLAG_DISCARD != 0 {
                return Err(bad(format!(
                    "log entry {} is a discard, which the harness does not model",
                    entry.index
                )));
            }
            if entry.has_data() {
                let mut buf = std::mem::take(&mut self.buf);
                self.log.read_data(&entry, &mut buf)?;
                self.image.write_all_at(&buf, entry.sector * SECTOR)?;
                self.buf = buf;
            }
            self.next += 1;
        }
        Ok(())
    }

    /// Copies the image as it stands to `path` (holes kept).
    pub fn save(&self, path: &Path) -> io::Result<()> {
        self.image.sync_data()?;
        sparse_copy_file(&self.image, path)
    }
}

/// Copies the file at `src` to `dst` (created or truncated), keeping holes.
pub fn sparse_copy(src: &Path, dst: &Path) -> io::Result<()> {
    let file =
        File::open(src).map_err(|e| io::Error::new(e.kind(), format!("{}: {e}", src.display())))?;
    sparse_copy_file(&file, dst)
}

fn sparse_copy_file(src: &File, dst: &Path) -> io::Result<()> {
    use rustix::fs::SeekFrom;
    let len = src.metadata()?.len();
    let out = File::create(dst)
        .map_err(|e| io::Error::new(e.kind(), format!("{}: {e}", dst.display())))?;
    out.set_len(len)?;
    let mut pos = 0u64;
    while pos < len {
        let data = match rustix::fs::seek(src, SeekFrom::Data(pos)) {
            Ok(d) => d,
            Err(rustix::io::Errno::NXIO) => break,
            Err(e) => return Err(e.into()),
        };
        let hole = rustix::fs::seek(src, SeekFrom::Hole(data))?.min(len);
        let mut off_in = data;
        let mut off_out = data;
        while off_in < hole {
            let want = usize::try_from(hole - off_in).unwrap_or(usize::MAX);
            let n = rustix::fs::copy_file_range(
                src,
                Some(&mut off_in),
                &out,
                Some(&mut off_out),
                want,
            )?;
            if n == 0 {
                return Err(bad(format!("short copy to {}", dst.display())));
            }
        }
        pos = hole;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn entry(sector: u64, nr: u64, flags: u64) -> Vec<u8> {
        let mut s = vec![0u8; SECTOR as usize];
        s[0..8].copy_from_slice(&sector.to_le_bytes());
        s[8..16].copy_from_slice(&nr.to_le_bytes());
        s[16..24].copy_from_slice(&flags.to_le_bytes());
        s
    }

    fn super_block(nr: u64) -> Vec<u8> {
        let mut s = vec![0u8; SECTOR as usize];
        s[0..8].copy_from_slice(&LOG_MAGIC.to_le_bytes());
        s[8..16].copy_from_slice(&LOG_VERSION.to_le_bytes());
        s[16..24].copy_from_slice(&nr.to_le_bytes());
        s[24..28].copy_from_slice(&512u32.to_le_bytes());
        s
    }

    #[test]
    fn parses_and_replays_a_log_prefix_by_prefix() {
        let dir = tempfile::tempdir().unwrap();
        let log_path = dir.path().join("log");
        let mut log = super_block(3);
        log.extend(entry(2, 2, 0));
        log.extend(vec![0xaa; 1024]);
        log.extend(entry(0, 0, FLAG_FLUSH));
        log.extend(entry(3, 1, FLAG_FUA));
        log.extend(vec![0xbb; 512]);
        // Past the last flush: logged, not counted by the super block.
        log.extend(entry(0, 1, 0));
        log.extend(vec![0xcc; 512]);
        File::create(&log_path).unwrap().write_all(&log).unwrap();
        let base = dir.path().join("base");
        File::create(&base).unwrap().set_len(8 * 512).unwrap();

        let parsed = WriteLog::open(&log_path).unwrap();
        assert_eq!(parsed.entries.len(), 4);
        assert_eq!(parsed.flushed_entries, 3);
        assert_eq!(parsed.barriers(), [1, 2]);
        assert_eq!(parsed.counts(), (3, 2, 0, 0));

        let img = dir.path().join("img");
        let mut r = Replayer::new(&parsed, &base, &img).unwrap();
        let read = |p: &Path| std::fs::read(p).unwrap();
        r.advance_to(1).unwrap();
        r.save(&dir.path().join("s1")).unwrap();
        let s1 = read(&dir.path().join("s1"));
        assert_eq!(&s1[1024..2048], &[0xaa; 1024][..]);
        assert_eq!(&s1[..1024], &[0; 1024][..]);
        r.advance_to(4).unwrap();
        let all = read(&img);
        assert_eq!(&all[1536..2048], &[0xbb; 512][..], "the later write wins");
        assert_eq!(&all[..512], &[0xcc; 512][..]);
        assert_eq!(all.len(), 8 * 512);
    }

    #[test]
    fn refuses_bad_magic_unknown_flags_and_truncated_data() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("log");
        let mut bad_magic = super_block(0);
        bad_magic[0] ^= 1;
        std::fs::write(&p, &bad_magic).unwrap();
        assert!(
            WriteLog::open(&p)
                .unwrap_err()
                .to_string()
                .contains("magic")
        );

        let mut flags = super_block(1);
        flags.extend(entry(0, 0, 1 << 9));
        std::fs::write(&p, &flags).unwrap();
        assert!(
            WriteLog::open(&p)
                .unwrap_err()
                .to_string()
                .contains("flags")
        );

        let mut short = super_block(1);
        short.extend(entry(0, 4, 0));
        short.extend(vec![1; 512]);
        std::fs::write(&p, &short).unwrap();
        assert!(
            WriteLog::open(&p)
                .unwrap_err()
                .to_string()
                .contains("past the end")
        );

        let mut missing = super_block(2);
        missing.extend(entry(0, 0, FLAG_FLUSH));
        std::fs::write(&p, &missing).unwrap();
        assert!(
            WriteLog::open(&p)
                .unwrap_err()
                .to_string()
                .contains("counts 2")
        );
    }
}
