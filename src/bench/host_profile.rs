//! `verl bench train-step --host-profile`: a sampling profile of the host threads (the caller
//! issuing burn operations and cubecl's device thread), summarised per thread as the functions
//! the samples are in (self) and under (inclusive): whether a step that issues thousands of
//! small operations is waiting on the GPU or on its own launch path, and where that time goes.

use std::collections::{HashMap, HashSet};

/// A running profile; [`HostProfile::report`] stops it.
pub(crate) struct HostProfile(pprof::ProfilerGuard<'static>);

/// Starts sampling every thread of the process `hz` times a second.
pub(crate) fn start(hz: i32) -> Result<HostProfile, String> {
    pprof::ProfilerGuardBuilder::default()
        .frequency(hz)
        .blocklist(&["libc", "libgcc", "pthread", "vdso"])
        .build()
        .map(HostProfile)
        .map_err(|e| format!("cannot start the host profiler: {e}"))
}

/// A demangled name without generic arguments or hash, short enough to read in a table.
fn short(name: &str) -> String {
    let mut out = String::new();
    let mut depth = 0usize;
    for ch in name.chars() {
        match ch {
            '<' => depth += 1,
            '>' => depth = depth.saturating_sub(1),
            _ if depth == 0 => out.push(ch),
            _ => {}
        }
    }
    let out = out.trim_end_matches(|c: char| c.is_ascii_hexdigit());
    out.strip_suffix("::h").unwrap_or(out).to_string()
}

impl HostProfile {
    /// Stops sampling and returns the per-thread tables, `top` rows each.
    pub(crate) fn report(self, top: usize) -> Result<String, String> {
        let report = self
            .0
            .report()
            .build()
            .map_err(|e| format!("cannot build the host profile: {e}"))?;
        // thread -> (total, self counts, inclusive counts)
        type Counts = HashMap<String, isize>;
        let mut threads: HashMap<String, (isize, Counts, Counts)> = HashMap::new();
        for (frames, &count) in &report.data {
            let entry = threads
                .entry(frames.thread_name_or_id())
                .or_insert_with(|| (0, HashMap::new(), HashMap::new()));
            entry.0 += count;
            let names: Vec<String> = frames
                .frames
                .iter()
                .flat_map(|f| f.iter().map(|s| short(&s.name())))
                .collect();
            if let Some(first) = names.first() {
                *entry.1.entry(first.clone()).or_default() += count;
            }
            let unique: HashSet<&String> = names.iter().collect();
            for name in unique {
                *entry.2.entry(name.clone()).or_default() += count;
            }
        }
        let mut out = String::new();
        let mut order: Vec<_> = threads.into_iter().collect();
        order.sort_by_key(|(_, (total, _, _))| -total);
        for (thread, (total, own, inclusive)) in order {
            if total < 10 {
                continue;
            }
            out.push_str(&format!("\n== thread {thread}: {total} samples\n"));
            for (title, counts) in [("self", own), ("inclusive", inclusive)] {
                let mut rows: Vec<_> = counts.into_iter().collect();
                rows.sort_by_key(|(_, c)| -c);
                out.push_str(&format!("-- {title}\n"));
                for (name, c) in rows.into_iter().take(top) {
                    let pct = 100.0 * c as f64 / total as f64;
                    let name: String = name.chars().take(150).collect();
                    out.push_str(&format!("{pct:6.1}%  {name}\n"));
                }
            }
        }
        Ok(out)
    }
}
