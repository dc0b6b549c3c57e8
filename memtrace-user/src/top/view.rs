//! The live view's own thread: it receives a snapshot at every sample, draws the process list (or
//! one process's stacks and subsystems) and reads the keys. q asks the run to end as Ctrl-C does:
//! it raises SIGINT at memtrace, which the tracing loop reads from its signalfd.

use std::{
    sync::{
        atomic::{AtomicU32, Ordering},
        mpsc::{Receiver, TryRecvError},
        Arc, Mutex,
    },
    time::Duration,
};

use nix::{
    sys::signal::{kill, Signal},
    unistd::Pid,
};
use ratatui::{
    crossterm::event::{self, Event, KeyCode, KeyEvent, KeyEventKind, KeyModifiers},
    layout::{Constraint, Layout, Rect},
    style::{Modifier, Style},
    text::{Line, Span},
    widgets::{Cell, Paragraph, Row as TableRow, Table, TableState},
    Frame,
};

use super::{
    snapshot::{sort_rows, Detail, Row, Snapshot, SortKey},
    terminal::{lock, Held, Screen},
};
use crate::export::format::{format_bytes, format_elapsed, format_signed_bytes};

/// How often the view looks at the keys and redraws when nothing else happens.
const TICK: Duration = Duration::from_millis(100);
/// Lines of memtrace's own messages (and a command's output) under the list.
const MESSAGE_LINES: usize = 3;
/// Headings: the help line, the list's titles, the opened process's name and sections.
const BOLD: Style = Style::new().add_modifier(Modifier::BOLD);

/// What the tracing side sends.
pub enum Update {
    Sample(Box<Snapshot>),
    /// Tracing has ended: the final figures.
    Ended(Box<Snapshot>),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Attaching,
    Tracing,
    Ended,
}

/// What a key asks of the view's loop.
#[derive(Debug, PartialEq, Eq)]
enum Action {
    None,
    /// End the run as SIGINT does.
    Stop,
    /// Give the terminal back (tracing has ended).
    Leave,
}

pub struct App {
    snapshot: Snapshot,
    phase: Phase,
    sort: SortKey,
    /// The selected process, by pid: it stays selected as the rows move.
    selected: Option<u32>,
    table: TableState,
    /// The process whose detail is shown (0: none), shared with the exporter, which asks for
    /// call stacks only while one is open.
    opened: Arc<AtomicU32>,
    stops_asked: u32,
    no_stacks: bool,
}

impl App {
    pub fn new(opened: Arc<AtomicU32>, no_stacks: bool) -> Self {
        Self {
            snapshot: Snapshot::default(),
            phase: Phase::Attaching,
            sort: SortKey::default(),
            selected: None,
            table: TableState::default(),
            opened,
            stops_asked: 0,
            no_stacks,
        }
    }

    fn receive(&mut self, update: Update) {
        let (snapshot, phase) = match update {
            Update::Sample(snapshot) => (snapshot, Phase::Tracing),
            Update::Ended(snapshot) => (snapshot, Phase::Ended),
        };
        self.snapshot = *snapshot;
        self.phase = phase;
        self.resort();
    }

    fn resort(&mut self) {
        sort_rows(&mut self.snapshot.rows, self.sort);
        let rows = &self.snapshot.rows;
        let index = self.selected.and_then(|pid| rows.iter().position(|r| r.pid == pid));
        let index = index.or((!rows.is_empty()).then_some(0));
        self.selected = index.map(|i| rows[i].pid);
        self.table.select(index);
    }

    fn opened(&self) -> Option<u32> {
        Some(self.opened.load(Ordering::Relaxed)).filter(|&pid| pid != 0)
    }

    fn on_key(&mut self, key: KeyEvent) -> Action {
        if key.kind == KeyEventKind::Release {
            return Action::None;
        }
        let ctrl_c = key.modifiers.contains(KeyModifiers::CONTROL) && key.code == KeyCode::Char('c');
        if key.code == KeyCode::Char('q') || ctrl_c {
            if self.phase == Phase::Ended {
                return Action::Leave;
            }
            self.stops_asked += 1;
            return Action::Stop;
        }
        match key.code {
            KeyCode::Char(c) if SortKey::from_key(c).is_some() => {
                self.sort = SortKey::from_key(c).unwrap_or_default();
                self.resort();
            }
            KeyCode::Enter => self.opened.store(self.selected.unwrap_or(0), Ordering::Relaxed),
            KeyCode::Esc => self.opened.store(0, Ordering::Relaxed),
            KeyCode::Up | KeyCode::Char('k') => self.move_selection(-1),
            KeyCode::Down | KeyCode::Char('j') => self.move_selection(1),
            KeyCode::PageUp => self.move_selection(-20),
            KeyCode::PageDown => self.move_selection(20),
            KeyCode::Home => self.move_selection(isize::MIN / 2),
            KeyCode::End => self.move_selection(isize::MAX / 2),
            _ => {}
        }
        Action::None
    }

    fn move_selection(&mut self, by: isize) {
        let rows = &self.snapshot.rows;
        if rows.is_empty() || self.opened().is_some() {
            return;
        }
        let current = self.table.selected().unwrap_or(0) as isize;
        let index = current.saturating_add(by).clamp(0, rows.len() as isize - 1) as usize;
        self.table.select(Some(index));
        self.selected = Some(rows[index].pid);
    }

    fn status(&self) -> String {
        let snapshot = &self.snapshot;
        let running = snapshot.rows.iter().filter(|r| !r.exited).count();
        let figures = format!(
            "{} · {} processes ({running} running) · {} events lost{}",
            format_elapsed(snapshot.elapsed),
            snapshot.rows.len(),
            snapshot.lost_events,
            if snapshot.sampled { " · heap figures estimated (--sample, --window)" } else { "" }
        );
        match self.phase {
            Phase::Attaching => "memtrace top: attaching probes...".to_owned(),
            Phase::Ended => format!("memtrace: tracing ended, final figures · {figures} · q quits"),
            Phase::Tracing if self.stops_asked > 0 => {
                format!("memtrace: stopping (q again stops tracing at once) · {figures}")
            }
            Phase::Tracing => format!("memtrace: tracing, every probe attached · {figures}"),
        }
    }

    fn help(&self) -> String {
        let sorts: Vec<String> = SortKey::ALL
            .iter()
            .map(|sort| {
                let mark = if *sort == self.sort { "*" } else { "" };
                format!("{} {}{mark}", sort.key(), sort.label())
            })
            .collect();
        match self.opened() {
            Some(_) => "Esc back · q quit".to_owned(),
            None => {
                format!("sort: {} · Up/Down select · Enter stacks and subsystems · q quit", sorts.join("  "))
            }
        }
    }

    pub fn draw(&mut self, frame: &mut Frame<'_>, messages: &[String]) {
        let [status, body, log, help] = Layout::vertical([
            Constraint::Length(1),
            Constraint::Min(3),
            Constraint::Length(MESSAGE_LINES as u16),
            Constraint::Length(1),
        ])
        .areas(frame.area());
        frame.render_widget(
            Paragraph::new(self.status()).style(Style::default().add_modifier(Modifier::REVERSED)),
            status,
        );
        match self.opened().map(|pid| self.snapshot.detail.as_ref().filter(|d| d.pid == pid)) {
            Some(detail) => self.draw_detail(frame, body, detail),
            None => self.draw_list(frame, body),
        }
        let lines: Vec<Line<'_>> = messages.iter().map(|m| Line::raw(m.as_str())).collect();
        frame.render_widget(Paragraph::new(lines), log);
        frame.render_widget(Paragraph::new(self.help()).style(BOLD), help);
    }

    fn draw_list(&mut self, frame: &mut Frame<'_>, area: Rect) {
        let sorted = match self.sort {
            SortKey::LiveHeap => 2,
            SortKey::Growth => 3,
            SortKey::Rss => 5,
            SortKey::Dark => 6,
        };
        let titles = ["PID", "COMMAND", "LIVE HEAP", "GROWTH", "BLOCKS", "RSS", "DARK", "ALLOCATOR", "STATE"];
        let header = TableRow::new(titles.iter().enumerate().map(|(i, title)| {
            Cell::from(*title).style(if i == sorted { BOLD.add_modifier(Modifier::UNDERLINED) } else { BOLD })
        }));
        let rows = self.snapshot.rows.iter().map(|row| TableRow::new(list_cells(row)));
        // Wide enough for the longest name (a command in a pod: `app [namespace/pod/container]`),
        // at most 48 columns, so that a long one leaves room for the figures.
        let longest = self.snapshot.rows.iter().map(|row| row.name.chars().count()).max().unwrap_or(0);
        let widths = [
            Constraint::Length(8),
            Constraint::Length(longest.clamp(16, 48) as u16),
            Constraint::Length(11),
            Constraint::Length(11),
            Constraint::Length(9),
            Constraint::Length(10),
            Constraint::Length(10),
            Constraint::Length(10),
            Constraint::Length(7),
        ];
        let table = Table::new(rows, widths)
            .header(header)
            .row_highlight_style(Style::default().add_modifier(Modifier::REVERSED));
        frame.render_stateful_widget(table, area, &mut self.table);
    }

    fn draw_detail(&self, frame: &mut Frame<'_>, area: Rect, detail: Option<&Detail>) {
        let row = self.opened().and_then(|pid| self.snapshot.rows.iter().find(|r| r.pid == pid));
        let lines = match (row, detail) {
            (Some(row), Some(detail)) => detail_lines(row, detail, self.no_stacks),
            (Some(row), None) => {
                vec![Line::raw(format!("pid {} ({}): reading at the next sample...", row.pid, row.name))]
            }
            (None, _) => vec![Line::raw("this process is no longer traced; Esc goes back")],
        };
        frame.render_widget(Paragraph::new(lines), area);
    }
}

fn list_cells(row: &Row) -> Vec<String> {
    vec![
        row.pid.to_string(),
        row.name.clone(),
        format_signed_bytes(row.stats.live_bytes, false),
        format_signed_bytes(row.growth_bytes, true),
        row.stats.live_allocations.to_string(),
        format_bytes(row.memory.rss_bytes()),
        format_bytes(row.memory.dark_bytes),
        row.allocator_kind.clone(),
        if row.exited { "exited" } else { "running" }.to_owned(),
    ]
}

/// The opened process: its figures, its subsystems and, once read, its heaviest stacks and
/// functions.
fn detail_lines<'a>(row: &Row, detail: &Detail, no_stacks: bool) -> Vec<Line<'a>> {
    let mut lines = figure_lines(row);
    lines.push(subsystems_line(detail));
    lines.push(Line::raw(""));
    match (no_stacks, detail.stacks_read) {
        (true, _) => lines.push(Line::raw("no call stacks (--no-stacks)")),
        (false, false) => lines.push(Line::raw("reading the call stacks at the next sample...")),
        (false, true) => lines.extend(stack_lines(detail)),
    }
    lines
}

/// Who the process is, what its heap did, and its memory level by level: the OS's levels on one
/// line, the allocator's and the program's on the next.
fn figure_lines<'a>(row: &Row) -> Vec<Line<'a>> {
    let stats = &row.stats;
    let exited = if row.exited { ", exited" } else { "" };
    let mut lines = vec![
        Line::styled(format!("pid {} {} via {}{exited}", row.pid, row.name, row.allocator_kind), BOLD),
        Line::raw(format!(
            "live heap {} in {} blocks · growth {} · allocated {} in {} · freed {} in {}",
            format_signed_bytes(stats.live_bytes, false),
            stats.live_allocations,
            format_signed_bytes(row.growth_bytes, true),
            format_bytes(stats.allocated_bytes),
            stats.allocations,
            format_bytes(stats.freed_bytes),
            stats.frees
        )),
    ];
    let levels = row.memory.named();
    // What the OS says; what the allocator and the program took; who owns the resident pages.
    for part in [&levels[..4], &levels[4..8], &levels[8..]] {
        let named: Vec<String> = part
            .iter()
            .map(|(name, bytes)| {
                let bytes = bytes.map_or_else(|| "?".to_owned(), format_bytes);
                format!("{} {bytes}", name.trim_end_matches("_bytes"))
            })
            .collect();
        lines.push(Line::raw(named.join(" · ")));
    }
    lines
}

/// The process's USDT subsystems, as it last reported them.
fn subsystems_line<'a>(detail: &Detail) -> Line<'a> {
    let subsystems: Vec<String> = detail
        .subsystems
        .iter()
        .map(|(name, bytes)| format!("{name} {}", format_signed_bytes(*bytes, false)))
        .collect();
    Line::raw(match subsystems.is_empty() {
        true => "subsystems: none reported".to_owned(),
        false => format!("subsystems: {}", subsystems.join(" · ")),
    })
}

/// The stacks holding the most live bytes, then the functions by live bytes.
fn stack_lines<'a>(detail: &Detail) -> Vec<Line<'a>> {
    let mut lines = vec![Line::styled("call stacks by live bytes (innermost first):", BOLD)];
    for stack in &detail.stacks {
        let frames: Vec<String> = stack.frames.iter().map(|frame| frame.name()).collect();
        lines.push(Line::from(vec![
            Span::raw(format!(
                "{:>10} {:>7} blocks  ",
                format_signed_bytes(stack.totals.live_bytes, false),
                stack.totals.live_allocations
            )),
            Span::raw(frames.join(" < ")),
        ]));
    }
    lines.push(Line::raw(""));
    lines.push(Line::styled("functions by live bytes (inclusive / exclusive):", BOLD));
    for function in &detail.functions {
        lines.push(Line::raw(format!(
            "{:>10} {:>10}  {}",
            format_signed_bytes(function.live_inclusive_bytes, false),
            format_signed_bytes(function.live_exclusive_bytes, false),
            function.name
        )));
    }
    lines
}

/// Whether SIGINT or SIGTERM waits for memtrace (nobody reads the signalfd once tracing ended).
fn termination_pending() -> bool {
    // SAFETY: sigpending writes the set of pending signals into the sigset_t it is given.
    unsafe {
        let mut pending: libc::sigset_t = std::mem::zeroed();
        libc::sigpending(&mut pending) == 0
            && (libc::sigismember(&pending, libc::SIGINT) == 1
                || libc::sigismember(&pending, libc::SIGTERM) == 1)
    }
}

/// The view's loop: until tracing has ended and the user quits (or the run ended on a signal, or
/// the tracing side went away). Returns the screen, for the caller to give back.
pub fn run(mut screen: Screen, updates: Receiver<Update>, mut app: App, held: Arc<Mutex<Held>>) -> Screen {
    loop {
        loop {
            match updates.try_recv() {
                Ok(update) => app.receive(update),
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => return screen,
            }
        }
        if app.phase == Phase::Ended && (app.stops_asked > 0 || termination_pending()) {
            return screen;
        }
        let messages = lock(&held).recent(MESSAGE_LINES);
        let _ = screen.terminal.draw(|frame| app.draw(frame, &messages));
        let key = match event::poll(TICK) {
            Ok(false) => continue,
            Ok(true) => match event::read() {
                Ok(Event::Key(key)) => key,
                Ok(_) => continue,
                Err(_) => break,
            },
            Err(_) => break,
        };
        match app.on_key(key) {
            Action::None => {}
            Action::Stop => {
                let _ = kill(Pid::this(), Signal::SIGINT);
            }
            Action::Leave => return screen,
        }
    }
    // The terminal went away: end the run as a hang-up would, and give the terminal back.
    if app.phase != Phase::Ended {
        let _ = kill(Pid::this(), Signal::SIGINT);
    }
    screen
}

#[cfg(test)]
mod tests {
    use super::*;
    use memtrace_common::ProcessStats;

    use crate::model::levels::MemoryLevels;

    fn row(pid: u32, live: i64) -> Row {
        Row {
            pid,
            name: format!("p{pid}"),
            allocator_kind: "glibc".into(),
            stats: ProcessStats { live_bytes: live, live_allocations: 2, ..ProcessStats::default() },
            memory: MemoryLevels::default(),
            growth_bytes: 0,
            exited: false,
        }
    }

    fn key(code: KeyCode) -> KeyEvent {
        KeyEvent::new(code, KeyModifiers::NONE)
    }

    fn app_with(rows: Vec<Row>) -> App {
        let mut app = App::new(Arc::default(), false);
        app.receive(Update::Sample(Box::new(Snapshot { rows, ..Snapshot::default() })));
        app
    }

    #[test]
    fn the_selection_follows_its_process_across_sorts() {
        let mut app = app_with(vec![row(1, 10), row(2, 30), row(3, 20)]);
        assert_eq!(app.selected, Some(2), "the largest live heap first");
        assert_eq!(app.on_key(key(KeyCode::Down)), Action::None);
        assert_eq!(app.selected, Some(3));
        app.snapshot.rows[0].growth_bytes = 5;
        app.on_key(key(KeyCode::Char('g')));
        assert_eq!(app.sort, SortKey::Growth);
        assert_eq!(app.selected, Some(3));
        assert_eq!(app.table.selected(), Some(2), "pid 2 grew, then 1 and 3 by pid");
        app.on_key(key(KeyCode::Enter));
        assert_eq!(app.opened(), Some(3));
        app.on_key(key(KeyCode::Esc));
        assert_eq!(app.opened(), None);
    }

    #[test]
    fn q_stops_tracing_then_leaves_once_it_ended() {
        let mut app = app_with(vec![row(1, 10)]);
        assert_eq!(app.on_key(key(KeyCode::Char('q'))), Action::Stop);
        assert!(app.status().contains("q again stops tracing at once"), "{}", app.status());
        assert_eq!(app.on_key(KeyEvent::new(KeyCode::Char('c'), KeyModifiers::CONTROL)), Action::Stop);
        app.receive(Update::Ended(Box::default()));
        assert_eq!(app.on_key(key(KeyCode::Char('q'))), Action::Leave);
    }

    #[test]
    fn the_status_says_when_every_probe_is_attached() {
        let mut app = App::new(Arc::default(), false);
        assert!(app.status().contains("attaching"));
        app.receive(Update::Sample(Box::new(Snapshot { rows: vec![row(1, 10)], ..Snapshot::default() })));
        assert!(app.status().starts_with("memtrace: tracing, every probe attached"), "{}", app.status());
        assert!(app.status().contains("1 processes (1 running) · 0 events lost"));
    }

    #[test]
    fn the_detail_shows_stacks_only_once_read() {
        let text = |lines: Vec<Line<'_>>| lines.iter().map(|line| line.to_string()).collect::<Vec<_>>();
        let mut detail = Detail {
            pid: 42,
            stacks_read: false,
            stacks: Vec::new(),
            functions: Vec::new(),
            subsystems: [("cache".to_owned(), 2048)].into(),
        };
        let lines = text(detail_lines(&row(42, 5768), &detail, false));
        assert_eq!(lines[0], "pid 42 p42 via glibc");
        assert!(lines[1].starts_with("live heap 5768 B in 2 blocks · growth 0 ·"), "{lines:?}");
        assert_eq!(
            lines[5..],
            ["subsystems: cache 2048 B", "", "reading the call stacks at the next sample..."]
        );
        assert_eq!(text(detail_lines(&row(42, 5768), &detail, true))[7], "no call stacks (--no-stacks)");
        detail.stacks_read = true;
        let lines = text(detail_lines(&row(42, 5768), &detail, false));
        assert_eq!(
            lines[7..],
            [
                "call stacks by live bytes (innermost first):",
                "",
                "functions by live bytes (inclusive / exclusive):"
            ]
        );
    }

    #[test]
    fn list_cells_show_exact_small_heaps() {
        let cells = list_cells(&row(42, 5768));
        assert_eq!(cells[..5], ["42", "p42", "5768 B", "0", "2"]);
    }
}
