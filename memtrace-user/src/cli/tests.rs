//! Tests of the command line: durations, the one kind of target a run takes, each subcommand's
//! options, the kernel's limit on --max-allocations, and the listen and push addresses it accepts.

use std::{path::PathBuf, time::Duration};

use memtrace_common::MAX_LIVE_ALLOCATIONS_LIMIT;

use super::*;
use clap::{error::ErrorKind, CommandFactory};

#[test]
fn durations_take_units() {
    assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
    assert_eq!(parse_duration("2s"), Ok(Duration::from_secs(2)));
    assert_eq!(parse_duration("1m30s"), Ok(Duration::from_secs(90)));
    assert!(parse_duration("soon").unwrap_err().contains("e.g. 250ms"));
    assert!(parse_duration("5").is_err());
    assert!(parse_interval("0s").is_err());
}

#[test]
fn needs_exactly_one_kind_of_target() {
    Cli::command().debug_assert();
    let missing = Cli::try_parse_from(["memtrace"]).unwrap_err();
    assert_eq!(missing.kind(), ErrorKind::MissingRequiredArgument);
    let both = Cli::try_parse_from(["memtrace", "--pid", "1", "--", "true"]).unwrap_err();
    assert_eq!(both.kind(), ErrorKind::ArgumentConflict);
    let cli = Cli::try_parse_from(["memtrace", "-p", "1", "--pid", "2", "-i", "250ms"]).unwrap();
    assert_eq!(cli.run.pids, [1, 2]);
    assert_eq!(cli.run.interval, Duration::from_millis(250));
    let cli = Cli::try_parse_from(["memtrace", "--", "ls", "-l"]).unwrap();
    assert_eq!(cli.run.command, ["ls", "-l"]);
    assert!(Cli::try_parse_from(["memtrace", "-p", "0"]).is_err());
}

#[test]
fn comm_is_repeatable_and_implies_all() {
    let cli = Cli::try_parse_from(["memtrace", "--comm", "nginx", "--comm", "php-fpm"]).unwrap();
    assert_eq!(cli.run.comms, ["nginx", "php-fpm"]);
    assert!(!cli.run.all, "--comm implies --all in the plan, not in the parser");
    assert!(Cli::try_parse_from(["memtrace", "--all", "--comm", "a", "--exclude-pid", "7"]).is_ok());
    assert!(Cli::try_parse_from(["memtrace", "--comm", "a", "--exclude-pid", "7"]).is_ok());
    let conflict = Cli::try_parse_from(["memtrace", "--comm", "a", "--pid", "1"]).unwrap_err();
    assert_eq!(conflict.kind(), ErrorKind::ArgumentConflict);
    let conflict = Cli::try_parse_from(["memtrace", "--comm", "a", "--", "ls"]).unwrap_err();
    assert_eq!(conflict.kind(), ErrorKind::ArgumentConflict);
    assert!(Cli::try_parse_from(["memtrace", "--pid", "1", "--exclude-pid", "7"]).is_err());
    let long = Cli::try_parse_from(["memtrace", "--comm", "a-very-long-program"]).unwrap_err();
    assert!(long.to_string().contains("`a-very-long-pro`"), "{long}");
    assert!(Cli::try_parse_from(["memtrace", "--comm", ""]).is_err());
}

#[test]
fn serve_takes_the_node_name_as_host_name() {
    let cli = Cli::try_parse_from(["memtrace", "serve", "--all", "--host-name", "node-7"]).unwrap();
    let Some(Subcommand::Serve(args)) = &cli.subcommand else {
        panic!("no serve subcommand");
    };
    assert_eq!(args.host_name.as_deref(), Some("node-7"));
    // What a pod gets when NODE_NAME is not in its environment: the kubelet leaves $(NODE_NAME)
    // as it is, which is a name; an empty one or one with spaces is refused.
    for bad in ["", "node 7"] {
        let err = Cli::try_parse_from(["memtrace", "serve", "--all", "--host-name", bad]).unwrap_err();
        assert!(err.to_string().contains("spec.nodeName"), "{err}");
    }
}

#[test]
fn serve_takes_the_target_options_of_a_run() {
    let cli = Cli::try_parse_from(["memtrace", "serve", "--pid", "7", "-i", "250ms"]).unwrap();
    let Some(Subcommand::Serve(args)) = &cli.subcommand else {
        panic!("no serve subcommand");
    };
    assert_eq!(args.listen.to_string(), "127.0.0.1:9464");
    assert_eq!(args.max_series_processes, 100);
    let tracing = &args.run;
    assert_eq!((tracing.pids.as_slice(), tracing.interval), ([7].as_slice(), Duration::from_millis(250)));
    assert!(!tracing.all && tracing.output.is_none() && tracing.summary.is_none());
    let cli =
        Cli::try_parse_from(["memtrace", "serve", "--comm", "nginx", "--listen", "0.0.0.0:9100"]).unwrap();
    let Some(Subcommand::Serve(args)) = cli.subcommand else {
        panic!("no serve subcommand");
    };
    assert_eq!(args.run.comms, ["nginx"]);
    assert_eq!(args.listen.to_string(), "0.0.0.0:9100");
    // Every option of a run: a tree, the stack table, the exited processes kept, a command.
    let cli = Cli::try_parse_from([
        "memtrace",
        "serve",
        "--pid",
        "7",
        "--children",
        "--max-stacks",
        "4096",
        "--keep-exited",
        "5",
    ])
    .unwrap();
    let Some(Subcommand::Serve(args)) = &cli.subcommand else {
        panic!("no serve subcommand");
    };
    assert!(args.run.children);
    assert_eq!((args.run.max_stacks, args.run.keep_exited), (4096, 5));
    let cli = Cli::try_parse_from(["memtrace", "serve", "--", "./app", "--port", "1"]).unwrap();
    let Some(Subcommand::Serve(args)) = &cli.subcommand else {
        panic!("no serve subcommand");
    };
    assert_eq!(args.run.command, ["./app", "--port", "1"]);
    let missing = Cli::try_parse_from(["memtrace", "serve"]).unwrap_err();
    assert_eq!(missing.kind(), ErrorKind::MissingRequiredArgument);
    let both = Cli::try_parse_from(["memtrace", "serve", "--pid", "1", "--all"]).unwrap_err();
    assert_eq!(both.kind(), ErrorKind::ArgumentConflict);
    assert!(Cli::try_parse_from(["memtrace", "serve", "--all", "--max-series-processes", "0"]).is_err());
    assert!(Cli::try_parse_from(["memtrace", "serve", "--all", "--listen", ":9464"]).is_err());
}

#[test]
fn top_takes_the_options_of_a_run() {
    let cli =
        Cli::try_parse_from(["memtrace", "top", "--comm", "nginx", "-i", "250ms", "--summary", "s.json"])
            .unwrap();
    let Some(Subcommand::Top(run)) = &cli.subcommand else {
        panic!("no top subcommand");
    };
    assert!(run.comms == ["nginx"] && run.interval == Duration::from_millis(250));
    assert_eq!(run.summary.as_deref(), Some(std::path::Path::new("s.json")));
    let cli = Cli::try_parse_from(["memtrace", "top", "--", "./server", "--port", "1"]).unwrap();
    let Some(Subcommand::Top(run)) = &cli.subcommand else {
        panic!("no top subcommand");
    };
    assert_eq!(run.command, ["./server", "--port", "1"]);
    let missing = Cli::try_parse_from(["memtrace", "top"]).unwrap_err();
    assert_eq!(missing.kind(), ErrorKind::MissingRequiredArgument);
    let both = Cli::try_parse_from(["memtrace", "top", "--pid", "1", "--", "ls"]).unwrap_err();
    assert_eq!(both.kind(), ErrorKind::ArgumentConflict);
    assert!(Cli::try_parse_from(["memtrace", "--pid", "1", "top", "--all"]).is_err());
    let cli = Cli::try_parse_from(["memtrace", "--", "top"]).unwrap();
    assert_eq!(cli.run.command, ["top"], "after -- a command may be called top");
}

#[test]
fn max_allocations_stops_at_the_kernel_limit() {
    let limit = MAX_LIVE_ALLOCATIONS_LIMIT.to_string();
    let cli = Cli::try_parse_from(["memtrace", "--all", "--max-allocations", &limit]).unwrap();
    assert_eq!(cli.run.max_allocations, MAX_LIVE_ALLOCATIONS_LIMIT);
    let beyond = (MAX_LIVE_ALLOCATIONS_LIMIT + 1).to_string();
    let error = Cli::try_parse_from(["memtrace", "--all", "--max-allocations", &beyond]).unwrap_err();
    assert!(error.to_string().contains(&limit), "{error}");
}

#[test]
fn usdt_options_and_subcommand() {
    let cli = Cli::try_parse_from([
        "memtrace",
        "--usdt",
        "app:tick",
        "--usdt",
        "./lib.so:app:size=arg1",
        "--",
        "usdt",
    ])
    .unwrap();
    assert_eq!(cli.run.usdt.len(), 2);
    assert_eq!(cli.run.usdt[1].argument, Some(1));
    assert_eq!(cli.run.command, ["usdt"], "after -- a command may be called usdt");
    assert!(cli.subcommand.is_none());
    let bad = Cli::try_parse_from(["memtrace", "--usdt", "tick", "--", "x"]).unwrap_err();
    assert_eq!(bad.kind(), ErrorKind::ValueValidation);
    let cli = Cli::try_parse_from(["memtrace", "usdt", "--pid", "7"]).unwrap();
    let Some(Subcommand::Usdt(args)) = cli.subcommand else {
        panic!("no subcommand");
    };
    assert_eq!((args.pid, args.path), (Some(7), None));
    let cli = Cli::try_parse_from(["memtrace", "usdt", "/bin/true"]).unwrap();
    let Some(Subcommand::Usdt(args)) = cli.subcommand else {
        panic!("no subcommand");
    };
    assert_eq!(args.path, Some(PathBuf::from("/bin/true")));
    assert!(Cli::try_parse_from(["memtrace", "usdt"]).is_err());
    assert!(Cli::try_parse_from(["memtrace", "usdt", "--pid", "7", "/bin/true"]).is_err());
}

#[test]
fn doctor_takes_no_target_and_no_options() {
    let cli = Cli::try_parse_from(["memtrace", "doctor"]).unwrap();
    assert!(matches!(cli.subcommand, Some(Subcommand::Doctor)));
    let extra = Cli::try_parse_from(["memtrace", "doctor", "--pid", "7"]).unwrap_err();
    assert_eq!(extra.kind(), ErrorKind::UnknownArgument);
}

#[test]
fn listen_addresses_beyond_loopback_are_written_in_full() {
    assert_eq!(parse_listen("9464"), Ok("127.0.0.1:9464".parse().unwrap()));
    assert_eq!(parse_listen("0.0.0.0:9464"), Ok("0.0.0.0:9464".parse().unwrap()));
    assert_eq!(parse_listen("[::1]:80"), Ok("[::1]:80".parse().unwrap()));
    assert!(parse_listen(":9464").unwrap_err().contains("0.0.0.0:9464"));
    assert!(parse_listen("localhost:9464").unwrap_err().contains("127.0.0.1:9464"));
    assert!(parse_listen("9464x").is_err());
}

#[test]
fn push_urls_are_plain_http() {
    assert!(parse_push_url("http://127.0.0.1:4040").is_ok());
    assert_eq!(parse_push_url("http://pyro:4040/prefix").unwrap().path(), "/prefix");
    assert!(parse_push_url("https://pyro:4040").unwrap_err().contains("plain HTTP"));
    assert!(parse_push_url("pyro:4040").is_err());
    assert!(parse_push_url("http://pyro:4040/?x=1").is_err());
    assert_eq!(parse_otlp_url("http://otel:4318").unwrap().authority().unwrap().as_str(), "otel:4318");
    assert!(parse_otlp_url("ftp://otel:4318").unwrap_err().contains("4318"));
    assert!(parse_otlp_url("https://otel:4318").unwrap_err().contains("plain HTTP"));
}
