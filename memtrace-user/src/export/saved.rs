//! A saved run: a summary file (`--summary PATH`) read back into a `Model`, so that
//! `memtrace report RUN.json` makes every report again (pprof, flamegraph, HTML, OTLP, the text report)
//! through the same exporters as a run, without tracing again.

use std::{
    collections::{BTreeMap, HashSet},
    fs,
    path::Path,
    process::ExitCode,
    sync::Arc,
    time::Duration,
};

use anyhow::{bail, Context, Result};
use memtrace_common::{interpreter_stop, unwind_stop, ProcessStats};

use super::{
    report::TextReport,
    summary::{
        OomKillSummary, PeakStack, PeakSummary, ProcessSummary, StackSummary, Summary, SUMMARY_VERSION,
    },
};
use crate::{
    model::{
        frame::Frame,
        identity::ProcessIdentity,
        oom::{KillStack, OomKill},
        HeapPeak, Model, PeakConsumer, Process, RunEnd, StackProfile, UsdtFigures,
    },
    plan::ReportFiles,
};

/// `memtrace report RUN.json [--html PATH] [--pprof PATH] [--flamegraph PATH] [--perfetto PATH]`: the summary is
/// read whole before any output is opened, so bad input leaves nothing behind (main has checked
/// that no output is the summary itself, or another output). With no output named, the text
/// report goes to stderr as at the end of a run.
pub fn report(summary: &Path, reports: &ReportFiles, top: usize) -> Result<ExitCode> {
    let (model, end) = load(summary)?;
    let mut exporters = super::reports(reports, top)?;
    if exporters.is_empty() {
        exporters.push(Box::new(TextReport { top }));
    }
    let mut failed = false;
    for exporter in &mut exporters {
        match exporter.finish(&model, end) {
            Ok(()) => {
                if let Some(written) = exporter.written() {
                    eprintln!("memtrace: {written}");
                }
            }
            Err(err) => {
                eprintln!("memtrace: error: {err:#}");
                failed = true;
            }
        }
    }
    Ok(if failed { ExitCode::from(1) } else { ExitCode::SUCCESS })
}

/// Reads a summary file into the model it was written from, and how long that run lasted.
pub fn load(path: &Path) -> Result<(Model, RunEnd)> {
    let fix = "give the file a run wrote with `memtrace --summary PATH`";
    let text = fs::read_to_string(path)
        .map_err(|err| anyhow::anyhow!("cannot read {} ({err}); {fix}", path.display()))?;
    let summary = parse(&text).with_context(|| format!("{} is not a memtrace summary", path.display()))?;
    into_model(summary).with_context(|| format!("{} is not a whole memtrace summary; {fix}", path.display()))
}

/// The summary in a file's text, or why the text is not one (and what to give instead).
fn parse(text: &str) -> Result<Summary> {
    if text.trim_start().starts_with('[') {
        bail!(
            "it is a trace file (Chrome trace-event JSON, `-o`), which keeps no call stacks; give the \
             file a run wrote with `--summary PATH`"
        );
    }
    let value: serde_json::Value = serde_json::from_str(text).context(
        "it is not JSON; give the file a run wrote with `memtrace --summary PATH`, as it was written",
    )?;
    match value.get("version").and_then(serde_json::Value::as_u64) {
        Some(version) if version == u64::from(SUMMARY_VERSION) => {}
        Some(version) => bail!(
            "it has version {version}, and this memtrace reads version {SUMMARY_VERSION}; make the report \
             with the memtrace that recorded the run, or record it again with `memtrace --summary PATH`"
        ),
        None => {
            bail!("it has no summary `version`; give the file a run wrote with `memtrace --summary PATH`")
        }
    }
    serde_json::from_value(value)
        .context("a field is missing or of the wrong kind; give the file as `memtrace --summary` wrote it")
}

fn into_model(summary: Summary) -> Result<(Model, RunEnd)> {
    let frames: Vec<Arc<Frame>> = summary.frame_table.into_iter().map(Arc::new).collect();
    let mut model = Model {
        kernel_maps: summary.kernel_maps,
        sampling: summary.sampling,
        app_sampled: summary.app_sampled,
        windows: summary.windows,
        single_stepped: summary.single_stepped,
        library_loads_held: summary.library_loads_held,
        ..Model::default()
    };
    // A pid that appears again later in the list was a retired process (one that ended before its
    // pid was taken by another): the list gives them first, in the order they ended.
    let mut later_pids = HashSet::new();
    let mut retired = vec![false; summary.processes.len()];
    for (index, process) in summary.processes.iter().enumerate().rev() {
        retired[index] = !later_pids.insert(process.pid);
    }
    let mut attributed = 0u64;
    for (process, retired) in summary.processes.into_iter().zip(retired) {
        attributed += process.stats.lost_events;
        let process = process_of(process, &frames)?;
        if retired {
            model.retired.push(process);
        } else {
            model.processes.insert(process.identity.pid, process);
        }
    }
    for folded in summary.folded {
        attributed += folded.lost_events;
        model.folded.insert(folded.comm.clone(), folded);
    }
    model.unattributed_lost_events = summary.lost_events.saturating_sub(attributed);
    let duration = Duration::try_from_secs_f64(summary.duration_s)
        .with_context(|| format!("`duration_s` {} is not a duration", summary.duration_s))?;
    Ok((model, RunEnd { duration }))
}

/// The counters named `names`, from the summary's `unwind_stops` (0 for a name it lacks).
fn stop_counts<const N: usize>(saved: &BTreeMap<String, u64>, names: [&str; N]) -> [u64; N] {
    names.map(|name| saved.get(name).copied().unwrap_or(0))
}

/// One process as the summary gave it; its stacks' frames are taken from the frame table.
fn process_of(saved: ProcessSummary, frames: &[Arc<Frame>]) -> Result<Process> {
    let unwind_stops = stop_counts(&saved.unwind_stops, unwind_stop::NAMES);
    let interpreter_stops = stop_counts(&saved.unwind_stops, interpreter_stop::NAMES);
    let mut comm = [0u8; 16];
    let kept = saved.comm.len().min(comm.len() - 1);
    comm[..kept].copy_from_slice(&saved.comm.as_bytes()[..kept]);
    let stats = ProcessStats {
        exited: u64::from(saved.exited),
        comm,
        unwind_stops,
        interpreter_stops,
        ..saved.stats
    };
    let usdt = UsdtFigures { subsystems: saved.subsystems, probes: saved.usdt };
    let pid = saved.pid;
    let stacks = saved
        .stacks
        .into_iter()
        .map(|stack| stack_of(stack, frames))
        .collect::<Result<_>>()
        .with_context(|| format!("the stacks of pid {pid}"))?;
    let peak = saved
        .peak
        .map(|peak| peak_of(peak, frames))
        .transpose()
        .with_context(|| format!("the peak of pid {pid}"))?;
    let oom_kill = saved
        .oom_kill
        .map(|kill| oom_kill_of(kill, frames))
        .transpose()
        .with_context(|| format!("the OOM kill of pid {pid}"))?;
    let identity = ProcessIdentity {
        pid,
        comm: saved.comm,
        executable: saved.executable,
        cgroup: saved.cgroup,
        container: saved.container,
        ..ProcessIdentity::default()
    };
    Ok(Process {
        identity,
        allocator: saved.allocator,
        allocator_kind: saved.allocator_kind,
        stats,
        memory: saved.memory.levels,
        free_pool: saved.memory.free_pool(),
        timeline: saved.timeline,
        peak,
        exited: saved.exited,
        seen_from_start: false,
        released: true,
        mappings: Vec::new(),
        stacks,
        usdt,
        oom_kill,
        window_weight: saved.window_weight,
        window_cpu: saved.window_cpu,
    })
}

fn stack_of(saved: StackSummary, frames: &[Arc<Frame>]) -> Result<StackProfile> {
    Ok(StackProfile {
        frames: frames_of(&saved.frame_ids, frames)?,
        totals: saved.totals,
        leaked_bytes: saved.leaked_bytes,
        leaked_allocations: saved.leaked_allocations,
        oldest_age: saved.oldest_age_s.and_then(|age| Duration::try_from_secs_f64(age).ok()),
    })
}

fn peak_of(saved: PeakSummary, frames: &[Arc<Frame>]) -> Result<HeapPeak> {
    let consumers = consumers_of(saved.stacks, frames)?;
    Ok(HeapPeak { ts_us: micros(saved.at_s), heap_live_bytes: saved.live_bytes, consumers })
}

fn oom_kill_of(saved: OomKillSummary, frames: &[Arc<Frame>]) -> Result<OomKill> {
    Ok(OomKill {
        ts_us: micros(saved.at_s),
        cgroup: saved.cgroup,
        limit_bytes: saved.limit_bytes,
        rss_bytes: saved.rss_bytes,
        live_bytes: saved.live_bytes,
        live_allocations: saved.live_allocations,
        stacks: consumers_of(saved.stacks, frames)?
            .into_iter()
            .map(|PeakConsumer { frames, live_bytes, live_allocations }| KillStack {
                frames,
                live_bytes,
                live_allocations,
            })
            .collect(),
        read: true,
    })
}

fn consumers_of(stacks: Vec<PeakStack>, frames: &[Arc<Frame>]) -> Result<Vec<PeakConsumer>> {
    stacks
        .into_iter()
        .map(|stack| {
            Ok(PeakConsumer {
                frames: frames_of(&stack.frame_ids, frames)?,
                live_bytes: stack.live_bytes,
                live_allocations: stack.live_allocations,
            })
        })
        .collect()
}

/// Seconds since tracing began, as the model keeps them.
fn micros(at_s: f64) -> u64 {
    (at_s.max(0.0) * 1e6).round() as u64
}

/// The frames a stack's `frame_ids` name in the frame table.
fn frames_of(ids: &[u32], frames: &[Arc<Frame>]) -> Result<Vec<Arc<Frame>>> {
    ids.iter()
        .map(|&id| {
            frames
                .get(id as usize)
                .cloned()
                .with_context(|| format!("frame {id} is not in `frame_table` ({} frames)", frames.len()))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use memtrace_common::StackTotals;

    use super::*;
    use crate::{
        export::{heap_profile::Processes, pprof::build_profile},
        model::{levels::MemoryLevels, TimelinePoint},
    };

    fn frame(name: &str, offset: u64) -> Arc<Frame> {
        Arc::new(Frame {
            function: Some(name.into()),
            file: Some("app.c".into()),
            line: Some(7),
            module: "/app".into(),
            offset,
            interpreter: None,
        })
    }

    /// A model as a run leaves it: two processes that had pid 9 (the first retired), stacks
    /// sharing frames, a timeline and a heap peak.
    fn run() -> Model {
        let mut model = Model::default();
        let main = frame("main", 0x10);
        let totals = StackTotals {
            started_ns: 0,
            allocations: 4,
            allocated_bytes: 400,
            live_allocations: 1,
            live_bytes: 100,
            temporary_allocations: 2,
            temporary_bytes: 200,
        };
        let stack = |frames: Vec<Arc<Frame>>| StackProfile {
            frames,
            totals,
            leaked_bytes: 100,
            leaked_allocations: 1,
            oldest_age: Some(Duration::from_millis(1500)),
        };
        for (comm, leaf) in [("old", "grow"), ("new", "cache")] {
            model.retire(9);
            model.add_process(crate::model::identity::ProcessIdentity::new(9, comm.into()), "/libc".into());
            let process = model.processes.get_mut(&9).unwrap();
            process.stats.allocations = 4;
            process.stats.live_bytes = 100;
            process.stats.lost_events = 1;
            process.stats.unwind_stops[0] = 3;
            process.stats.interpreter_stops[1] = 2;
            process.memory =
                MemoryLevels { rss_anon_bytes: 4096, dark_bytes: 1024, ..MemoryLevels::default() };
            process.timeline =
                vec![TimelinePoint { ts_us: 5, memory: process.memory, subsystems: Default::default() }];
            process.usdt.subsystems.insert("textures".into(), 12345);
            let counter = crate::model::UsdtProbeCounter { hits: 3, value: Some(-5) };
            process.usdt.probes.insert("app:size=arg1".into(), counter);
            process.stacks =
                vec![stack(vec![frame(leaf, 0x20), Arc::clone(&main)]), stack(vec![Arc::clone(&main)])];
            process.peak = Some(HeapPeak {
                ts_us: 250_000,
                heap_live_bytes: 100,
                consumers: vec![PeakConsumer {
                    frames: vec![frame(leaf, 0x20)],
                    live_bytes: 100,
                    live_allocations: 1,
                }],
            });
        }
        model.unattributed_lost_events = 2;
        model.sampling = Some(crate::model::estimate::Sampling::new(512 * 1024));
        model
    }

    #[test]
    fn a_summary_reads_back_into_the_model_it_was_written_from() {
        let model = run();
        let end = RunEnd { duration: Duration::from_millis(1500) };
        let text = serde_json::to_string_pretty(&Summary::of(&model, end, 10)).unwrap();
        let summary: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(summary["frame_table"].as_array().unwrap().len(), 3, "main, grow, cache: each once");
        assert!(text.contains("\n        {\"frame_ids\":[0,1],"), "one line per stack:\n{text}");

        let (loaded, loaded_end) = into_model(parse(&text).unwrap()).unwrap();
        assert_eq!(loaded_end.duration, end.duration);
        assert_eq!(loaded.lost_events(), model.lost_events());
        assert_eq!(loaded.sampling, model.sampling);
        let comms: Vec<&str> = loaded.every_process().map(|p| p.identity.comm.as_str()).collect();
        assert_eq!(comms, ["old", "new"], "the retired process stays first");
        for (before, after) in model.every_process().zip(loaded.every_process()) {
            assert_eq!(after.stats.allocations, before.stats.allocations);
            assert_eq!(after.stats.unwind_stops, before.stats.unwind_stops);
            assert_eq!(after.stats.interpreter_stops, before.stats.interpreter_stops);
            assert_eq!(after.memory, before.memory);
            assert_eq!(after.timeline, before.timeline);
            assert_eq!(after.usdt.subsystems, before.usdt.subsystems);
            assert_eq!(after.usdt.probes, before.usdt.probes);
            for (a, b) in before.stacks.iter().zip(&after.stacks) {
                assert_eq!(
                    (&a.frames, a.totals, a.leaked_bytes, a.oldest_age),
                    (&b.frames, b.totals, b.leaked_bytes, b.oldest_age)
                );
            }
            let (a, b) = (before.peak.as_ref().unwrap(), after.peak.as_ref().unwrap());
            assert_eq!(
                (a.ts_us, a.heap_live_bytes, &a.consumers[0].frames),
                (b.ts_us, b.heap_live_bytes, &b.consumers[0].frames)
            );
        }
        let profile = |model: &Model| build_profile(model, Duration::ZERO, Processes::All);
        assert_eq!(profile(&loaded), profile(&model), "pprof made again is the run's");
    }

    #[test]
    fn what_is_not_a_summary_says_what_it_is() {
        let error = |text: &str| format!("{:#}", parse(text).unwrap_err());
        assert!(error("[{\"ph\":\"M\"},\n").contains("trace file"));
        assert!(error("not json").contains("not JSON"));
        assert!(error("{\"version\": 7}").contains("version 7"));
        assert!(error("{\"processes\": []}").contains("no summary `version`"));
        assert!(error("{\"version\": 1}").contains("duration_s"));
        let text =
            serde_json::to_string(&Summary::of(&run(), RunEnd { duration: Duration::ZERO }, 10)).unwrap();
        let broken = text.replace("\"frame_ids\":[0,1]", "\"frame_ids\":[0,99]");
        let error = format!("{:#}", into_model(parse(&broken).unwrap()).unwrap_err());
        assert!(error.contains("frame 99 is not in `frame_table`") && error.contains("pid 9"), "{error}");
    }
}
