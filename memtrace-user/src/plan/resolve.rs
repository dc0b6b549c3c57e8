//! From the command line to the plan: the only room after main that reads crate::cli. Each fact
//! is worked out here once (system-wide or not, whether children follow, which files are written
//! by default), so that nothing downstream asks the command line again.

use std::{path::PathBuf, time::SystemTime};

use anyhow::Result;

use super::{
    Kernel, Mode, Outputs, Plan, ProbePlan, PushTarget, ReportFiles, Retention, Runtimes, ServeOptions,
    Tables, Targets, Timing,
};
use crate::{
    cli::{ReportOutputs, RunArgs, ServeArgs},
    kernel::features::KernelFeatures,
    kernel::ProcessFilter,
    process::{allocator::Overrides, cgroup::CgroupFilter},
};

/// The plan of a run of `mode` with the options `run`, on a kernel with `features`.
pub fn plan(run: RunArgs, mode: Mode, features: KernelFeatures) -> Result<Plan> {
    let targets = targets(&run);
    let kernel = Kernel::resolve(features, &targets.reach())?;
    // The agent without a command traces until a signal ends it.
    let serving = matches!(mode, Mode::Serve(_)) && run.command.is_empty();
    let system_wide = targets.system_wide();
    let probes = ProbePlan {
        tables: Tables { max_allocations: run.max_allocations, max_stacks: run.max_stacks },
        stacks: !run.no_stacks,
        interpreter_frames: !run.no_interpreter_frames,
        sample: run.sample,
        app_sampled: run.app_sampled,
        empty_probes: run.empty_probes,
        window: run.window,
        debug_bpf: run.debug_bpf,
        allocator: Overrides { lib: run.lib, prefix: run.allocator.as_deref().map(Overrides::prefix_for) },
        usdt: run.usdt,
        unwind_in_background: run.all,
    };
    let runtimes = Runtimes { containerd_socket: run.containerd_socket.clone() };
    let timing = Timing {
        interval: run.interval,
        duration: run.duration,
        ends_with_targets: !serving && !system_wide,
    };
    let retention = Retention {
        keep_exited: run.keep_exited,
        trim_released: system_wide.then_some(run.top),
        forget_released: serving,
    };
    // The agent and the live view write a trace only when -o names one.
    let default_trace = matches!(mode, Mode::Trace);
    let outputs = Outputs {
        trace: run.output.or_else(|| default_trace.then(default_output_path)),
        heap_subsystems: run.heap_subsystems,
        summary: run.summary,
        reports: report_files(run.reports),
        top: run.top,
        older: run.older,
    };
    Ok(Plan { mode, targets, probes, timing, outputs, retention, kernel, runtimes })
}

/// `memtrace serve`: the run the agent is, and its mode with what serving adds to it.
pub fn serve(args: ServeArgs) -> (RunArgs, Mode) {
    let options = ServeOptions {
        listen: args.listen,
        max_series_processes: args.max_series_processes as usize,
        interval: args.run.interval,
        max_allocations: args.run.max_allocations,
        push: args.push.map(|base| PushTarget { base, interval: args.push_interval }),
        host_name: args.host_name.unwrap_or_else(crate::process::procfs::host_name),
        otlp: args.otlp_endpoint.map(|base| PushTarget { base, interval: args.push_interval }),
        oom_dir: args.oom_dir,
    };
    (args.run, Mode::Serve(Box::new(options)))
}

/// The reports the options name.
pub fn report_files(reports: ReportOutputs) -> ReportFiles {
    let ReportOutputs { pprof, flamegraph, perfetto, html, otlp } = reports;
    ReportFiles { pprof, flamegraph, perfetto, html, otlp }
}

/// What the target options name: --pid, --all and a command exclude each other (clap has
/// checked), and --comm implies --all.
fn targets(run: &RunArgs) -> Targets {
    if run.all || !run.comms.is_empty() || !run.containers.is_empty() || !run.cgroups.is_empty() {
        Targets::System(ProcessFilter {
            self_tgid: std::process::id(),
            excluded_pids: run.exclude_pids.clone(),
            only_comms: run.comms.clone(),
            cgroups: CgroupFilter { containers: run.containers.clone(), paths: run.cgroups.clone() },
        })
    } else if run.command.is_empty() {
        Targets::Pids { pids: run.pids.clone(), children: run.children }
    } else {
        Targets::Command { argv: run.command.clone(), children: !run.no_children }
    }
}

fn default_output_path() -> PathBuf {
    // 2026-11-29T11:09:11Z -> memtrace-20261129-110911.json
    let stamp = humantime::format_rfc3339_seconds(SystemTime::now()).to_string();
    let digits: String = stamp.chars().filter(char::is_ascii_digit).collect();
    let (date, time) = digits.split_at(digits.len().min(8));
    PathBuf::from(format!("memtrace-{date}-{time}.json"))
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;
    use crate::cli::{Cli, Subcommand};

    fn targets_of(args: &[&str]) -> Targets {
        targets(&Cli::try_parse_from(args).unwrap().run)
    }

    #[test]
    fn default_output_is_timestamped() {
        let name = default_output_path().to_string_lossy().into_owned();
        assert!(name.starts_with("memtrace-") && name.ends_with(".json"), "{name}");
        assert_eq!(name.len(), "memtrace-20261129-110911.json".len(), "{name}");
    }

    #[test]
    fn comm_implies_all() {
        assert!(targets_of(&["memtrace", "--comm", "nginx", "--comm", "php-fpm"]).system_wide());
        assert!(targets_of(&["memtrace", "--all", "--comm", "a", "--exclude-pid", "7"]).system_wide());
        assert!(!targets_of(&["memtrace", "--pid", "1"]).system_wide());
    }

    #[test]
    fn children_follow_a_command_unless_told_and_pids_only_when_told() {
        assert!(targets_of(&["memtrace", "--", "ls"]).follows_children());
        assert!(!targets_of(&["memtrace", "--no-children", "--", "ls"]).follows_children());
        assert!(targets_of(&["memtrace", "--pid", "1", "--children"]).follows_children());
        assert!(!targets_of(&["memtrace", "--pid", "1"]).follows_children());
    }

    #[test]
    fn serve_and_top_are_modes_of_a_run() {
        let cli = Cli::try_parse_from(["memtrace", "serve", "--comm", "nginx", "--listen", "0.0.0.0:9100"])
            .unwrap();
        let Some(Subcommand::Serve(args)) = cli.subcommand else {
            panic!("no serve subcommand");
        };
        let (run, mode) = serve(*args);
        assert!(targets(&run).system_wide());
        let Mode::Serve(options) = mode else { panic!("not served") };
        assert_eq!(options.listen.to_string(), "0.0.0.0:9100");
        let cli = Cli::try_parse_from(["memtrace", "top", "--comm", "nginx"]).unwrap();
        let Some(Subcommand::Top(run)) = cli.subcommand else {
            panic!("no top subcommand");
        };
        assert!(targets(&run).system_wide());
        let cli = Cli::try_parse_from(["memtrace", "top", "--", "./server", "--port", "1"]).unwrap();
        let Some(Subcommand::Top(run)) = cli.subcommand else {
            panic!("no top subcommand");
        };
        assert!(targets(&run).follows_children());
    }
}
