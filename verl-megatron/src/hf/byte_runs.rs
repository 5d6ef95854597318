//! A checkpoint shard's bytes as runs read as one stream: one contiguous run per index of the
//! dimensions before the split one, borrowed from the mapped file. The device upload copies
//! ranges of the stream into its staging without gathering the shard into a host buffer first.

/// Byte runs read one after another.
pub struct ByteRuns<'a> {
    runs: &'a [&'a [u8]],
    /// Where each run starts in the stream.
    starts: Vec<usize>,
    total: usize,
}

impl<'a> ByteRuns<'a> {
    pub fn new(runs: &'a [&'a [u8]]) -> Self {
        let mut starts = Vec::with_capacity(runs.len());
        let mut total = 0;
        for r in runs {
            starts.push(total);
            total += r.len();
        }
        Self {
            runs,
            starts,
            total,
        }
    }

    /// Bytes in all runs.
    pub fn total(&self) -> usize {
        self.total
    }

    /// Copies stream bytes `from..from + dst.len()` into `dst`.
    ///
    /// # Panics
    /// If the range runs past the stream's end.
    pub fn copy_range(&self, from: usize, dst: &mut [u8]) {
        assert!(
            from + dst.len() <= self.total,
            "byte runs: {}..{} is past the stream's {} bytes",
            from,
            from + dst.len(),
            self.total
        );
        if dst.is_empty() {
            return;
        }
        // The run holding byte `from`: the last one starting at or before it (of several
        // starting there, the last: the others are empty).
        let mut r = self.starts.partition_point(|&s| s <= from) - 1;
        let mut done = 0;
        while done < dst.len() {
            let run = self.runs[r];
            let within = from + done - self.starts[r];
            let take = (run.len() - within).min(dst.len() - done);
            dst[done..done + take].copy_from_slice(&run[within..within + take]);
            done += take;
            r += 1;
        }
    }

    /// [`Self::copy_range`] split over up to `threads` host threads (one thread copies from
    /// the page cache at a few GB/s, short of what a PCIe or NVLink-C2C bus takes).
    pub fn copy_range_parallel(&self, from: usize, dst: &mut [u8], threads: usize) {
        const PART: usize = 8 << 20;
        let threads = threads.min(dst.len().div_ceil(PART)).max(1);
        if threads == 1 {
            return self.copy_range(from, dst);
        }
        let per = dst.len().div_ceil(threads);
        std::thread::scope(|s| {
            for (j, part) in dst.chunks_mut(per).enumerate() {
                s.spawn(move || self.copy_range(from + j * per, part));
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stream() -> (Vec<Vec<u8>>, Vec<u8>) {
        // Empty runs first, in the middle and last; runs of odd lengths.
        let lens = [0, 5, 0, 0, 17, 1, 0, 3_000_001, 9, 0];
        let runs: Vec<Vec<u8>> = lens
            .iter()
            .enumerate()
            .map(|(i, &n)| (0..n).map(|j| (i * 31 + j * 7) as u8).collect())
            .collect();
        let whole = runs.concat();
        (runs, whole)
    }

    #[test]
    fn any_range_reads_the_concatenation() {
        let (runs, whole) = stream();
        let refs: Vec<&[u8]> = runs.iter().map(Vec::as_slice).collect();
        let r = ByteRuns::new(&refs);
        assert_eq!(r.total(), whole.len());
        for (from, len) in [
            (0, 0),
            (0, 3),
            (3, 5),
            (5, 17),
            (21, 3),
            (22, 100),
            (0, whole.len()),
        ] {
            let mut dst = vec![0u8; len];
            r.copy_range(from, &mut dst);
            assert_eq!(dst, whole[from..from + len], "{from}+{len}");
        }
        let tail = whole.len() - 12;
        let mut dst = vec![0u8; 12];
        r.copy_range(tail, &mut dst);
        assert_eq!(dst, whole[tail..]);
    }

    #[test]
    fn threads_split_a_range_as_one_thread_reads_it() {
        let (runs, whole) = stream();
        let refs: Vec<&[u8]> = runs.iter().map(Vec::as_slice).collect();
        let r = ByteRuns::new(&refs);
        let (from, len) = (4, whole.len() - 13);
        let mut dst = vec![0u8; len];
        r.copy_range_parallel(from, &mut dst, 3);
        assert_eq!(dst, whole[from..from + len]);
    }

    #[test]
    #[should_panic(expected = "past the stream")]
    fn a_range_past_the_end_is_refused() {
        let data = [1u8, 2, 3];
        let refs: Vec<&[u8]> = vec![&data];
        ByteRuns::new(&refs).copy_range(2, &mut [0u8; 2]);
    }
}
