// memtrace's HTML report: draws the run embedded in the page (the summary JSON of `--summary`)
// with no library and no network. Canvases for the timeline, the treemap and the flamegraphs;
// flamegraphs are merged into a tree first and frames narrower than a pixel are not drawn.
'use strict';
(function () {
  const started = performance.now();
  const DATA = JSON.parse(document.getElementById('memtrace-data').textContent);
  const FRAMES = DATA.frame_table || [];
  const PROCS = DATA.processes || [];
  const LEVEL_COLORS = {
    heap_live_bytes: '#e8a33d', heap_overhead_bytes: '#f3d08f', allocator_held_bytes: '#b8741a',
    mapped_anon_bytes: '#5b9bd5', dark_bytes: '#2d2a32', rss_anon_bytes: '#8e44ad',
    rss_file_bytes: '#7fb98b', rss_shmem_bytes: '#a99bd4', swap_bytes: '#c0392b', subsystems: '#d95f5f',
    allocator_resident_bytes: '#c98a2b', allocator_free_resident_bytes: '#9fc5a8', mapped_anon_resident_bytes: '#5b9bd5',
    stack_bytes: '#8fa3bf', static_bytes: '#b39ddb',
  };
  const LEVEL_NAMES = {
    heap_live_bytes: 'heap live', heap_overhead_bytes: 'heap overhead', allocator_held_bytes: 'allocator held',
    mapped_anon_bytes: 'mapped anonymous', dark_bytes: 'dark memory', rss_anon_bytes: 'RSS anonymous',
    rss_file_bytes: 'RSS file', rss_shmem_bytes: 'RSS shmem', swap_bytes: 'swap', subsystems: 'subsystems (reported)',
    allocator_resident_bytes: 'allocator', allocator_free_resident_bytes: 'allocator free (resident)',
    mapped_anon_resident_bytes: 'program mappings', stack_bytes: 'stacks', static_bytes: 'static data',
  };
  /** The owners of the resident anonymous pages, which add up to RSS anonymous + swap (dark last). */
  const OWNERS = ['allocator_resident_bytes', 'mapped_anon_resident_bytes', 'stack_bytes', 'static_bytes', 'dark_bytes'];
  /** Whether a summary has the owners (one written before they existed has not). */
  function hasOwners(m) { return m && typeof m.allocator_resident_bytes === 'number'; }
  /** The allocator's free pool in words when it is large, as the text report says it. */
  function freeWords(p) {
    const m = p.memory || {}, free = m.allocator_free_resident_bytes;
    if (typeof free !== 'number' || free < 1048576 || free * 10 < (m.rss_anon_bytes || 0) + (m.swap_bytes || 0)) return '';
    const giver = p.allocator_kind === 'glibc' ? 'malloc_trim(0) would return them'
      : (p.allocator_kind || '').startsWith('jemalloc') ? 'a purge of its arenas would return them' : 'a trim of the allocator could return them';
    const arenas = m.allocator_arenas > 0 ? '; ' + m.allocator_arenas + (m.allocator_arenas === 1 ? ' arena' : ' arenas') : '';
    return 'the allocator keeps ' + bytes(free) + ' of resident free pages (' + giver + ')' + arenas;
  }

  // ---- helpers ----
  function el(tag, props, ...children) {
    const e = document.createElement(tag);
    for (const key in props || {}) {
      const value = props[key];
      if (key === 'class') e.className = value;
      else if (key === 'text') e.textContent = value;
      else if (key.startsWith('on')) e.addEventListener(key.slice(2), value);
      else e.setAttribute(key, value);
    }
    for (const child of children) if (child !== null && child !== undefined) e.append(child);
    return e;
  }
  function bytes(n) {
    n = Number(n) || 0;
    const sign = n < 0 ? '-' : '';
    let v = Math.abs(n);
    const units = ['B', 'KiB', 'MiB', 'GiB', 'TiB'];
    let u = 0;
    while (v >= 1024 && u < units.length - 1) { v /= 1024; u++; }
    return sign + (u === 0 ? String(v) : v.toFixed(v < 10 ? 2 : 1)) + ' ' + units[u];
  }
  function count(n) { return Math.round(Number(n) || 0).toLocaleString('en-US'); }
  function seconds(s) { return (Number(s) || 0).toFixed(3) + ' s'; }
  function percent(part, whole) { return whole > 0 ? (100 * part / whole).toFixed(1) + '%' : '-'; }
  function frameName(id) {
    const f = FRAMES[id];
    if (!f) return '?';
    if (f.function) return f.function;
    return f.module.split('/').pop() + '+0x' + Number(f.offset).toString(16);
  }
  function frameWhere(id) {
    const f = FRAMES[id];
    if (!f) return '';
    return f.file ? f.file + (f.line ? ':' + f.line : '') : f.module + '+0x' + Number(f.offset).toString(16);
  }
  function label(p) { return p.comm + where(p) + ' (' + p.pid + ')'; }
  // The container a process ran in, as model/identity.rs's display_name says it.
  function where(p) {
    var c = p.container;
    if (!c) return '';
    var pod = c.pod ? (c.namespace ? c.namespace + '/' : '') + c.pod : (c.pod_uid ? 'pod ' + c.pod_uid : '');
    var name = c.name || (c.id ? c.id.slice(0, 12) : '');
    return ' [' + [pod, name].filter(Boolean).join('/') + ']';
  }
  function hashHue(text) {
    let h = 2166136261;
    for (let i = 0; i < text.length; i++) { h ^= text.charCodeAt(i); h = Math.imul(h, 16777619); }
    return (h >>> 0) % 1000 / 1000;
  }
  function flameColor(name) {
    const t = hashHue(name);
    return 'hsl(' + Math.round(8 + 42 * t) + ',' + Math.round(70 + 20 * t) + '%,' + Math.round(55 + 12 * (1 - t)) + '%)';
  }
  /** A canvas of CSS size w x h, sharp on high-density screens. */
  function sizeCanvas(canvas, w, h) {
    const ratio = window.devicePixelRatio || 1;
    canvas.width = Math.max(1, Math.round(w * ratio));
    canvas.height = Math.max(1, Math.round(h * ratio));
    canvas.style.width = w + 'px';
    canvas.style.height = h + 'px';
    const ctx = canvas.getContext('2d');
    ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
    ctx.font = '11px system-ui, sans-serif';
    ctx.textBaseline = 'middle';
    return ctx;
  }
  function fitText(ctx, text, width) {
    const chars = Math.floor((width - 6) / 6.2);
    if (chars < 3) return '';
    return text.length <= chars ? text : text.slice(0, chars - 1) + '\u2026';
  }
  const tooltip = el('div', { id: 'tooltip' });
  function showTip(event, text) {
    tooltip.textContent = text;
    tooltip.style.display = 'block';
    const x = Math.min(event.clientX + 14, window.innerWidth - tooltip.offsetWidth - 8);
    const y = event.clientY + 16 + tooltip.offsetHeight > window.innerHeight ? event.clientY - tooltip.offsetHeight - 8 : event.clientY + 16;
    tooltip.style.left = Math.max(0, x) + 'px';
    tooltip.style.top = Math.max(0, y) + 'px';
  }
  function hideTip() { tooltip.style.display = 'none'; }
  function contentWidth(section) { return Math.max(300, section.clientWidth - 40); }
  function stackList(ids) {
    return el('ol', { class: 'stack' }, ...ids.map(id => el('li', null, frameName(id) + ' ', el('span', { text: frameWhere(id) }))));
  }
  /** A stack shown by its innermost frame, the whole stack on opening (built only then). */
  function stackCell(ids) {
    const details = el('details', null, el('summary', { text: ids.length ? frameName(ids[0]) : '(no frames)' }));
    details.addEventListener('toggle', () => {
      if (details.open && details.childNodes.length === 1) details.append(stackList(ids));
    }, { once: false });
    return el('td', { class: 'text' }, details);
  }
  function table(headers, rows) {
    const head = el('tr', null, ...headers.map(h => el('th', { class: h.startsWith('~') ? 'text' : '', text: h.replace(/^~/, '') })));
    return el('div', { class: 'scroll' }, el('table', null, el('thead', null, head), el('tbody', null, ...rows)));
  }

  // ---- the page ----
  const header = el('header', null, el('h1', { text: 'memtrace report' }));
  const sampling = DATA.sampling ? ' Sampled: allocations a mean of ' + bytes(DATA.sampling.mean_bytes) +
    ' apart; live figures, stacks and flamegraphs are estimates.' : '';
  const windows = DATA.windows ? ' Allocations probed in windows of ' + seconds(DATA.windows.on_s) + ' every ' +
    seconds(DATA.windows.every_s) + ' (' + seconds(DATA.windows.probed_s) + ' in all): heap figures are the windows\' scaled by ' +
    DATA.windows.weight.toFixed(2) + '; the stacks of what they recorded are exact.' : '';
  header.append(el('p', { class: 'note', text: PROCS.length + ' process' + (PROCS.length === 1 ? '' : 'es') +
    ' traced for ' + seconds(DATA.duration_s) + '.' + sampling + windows }));
  if (DATA.lost_events > 0) header.append(el('p', { class: 'warn', text: count(DATA.lost_events) + ' events could not be recorded: figures are low.' }));
  document.body.append(header, tooltip);
  document.title = 'memtrace: ' + (PROCS.length === 1 ? label(PROCS[0]) : PROCS.length + ' processes');

  const byLive = PROCS.map((p, i) => i).sort((a, b) => PROCS[b].live_bytes - PROCS[a].live_bytes);
  let chosen = byLive.length ? byLive[0] : -1;
  const processRows = new Map();

  const procSection = el('section', null, el('h2', { text: 'Processes' }),
    el('p', { class: 'note', text: 'Sorted by live heap. Click a process to show it below.' }));
  const shown = byLive.slice(0, 1000);
  procSection.append(table(['pid', '~command', 'heap live', 'peak', 'allocated', 'allocations', 'temporary', 'RSS', 'dark', 'lost'],
    shown.map(i => {
      const p = PROCS[i];
      const row = el('tr', { class: 'pick', onclick: () => choose(i) },
        el('td', { text: p.pid }), el('td', { class: 'text', text: p.comm + where(p) + (p.exited ? ' (exited)' : '') }),
        el('td', { text: bytes(p.live_bytes) }), el('td', { text: bytes(p.peak_live_bytes) }),
        el('td', { text: bytes(p.allocated_bytes) }), el('td', { text: count(p.allocations) }),
        el('td', { text: count(p.temporary_allocations) }), el('td', { text: bytes(p.rss_bytes) }),
        el('td', { text: bytes(p.memory ? p.memory.dark_bytes : 0) }), el('td', { text: count(p.lost_events) }));
      processRows.set(i, row);
      return row;
    })));
  if (byLive.length > shown.length) procSection.append(el('p', { class: 'note', text: (byLive.length - shown.length) + ' more processes, with less live heap, are not listed.' }));
  document.body.append(procSection);

  // ---- treemap: process -> level -> subsystem or call stack ----
  const treeSection = el('section', null, el('h2', { text: 'Memory by level' }),
    el('p', { class: 'note', text: 'Each process\u2019s resident anonymous memory and swap by owner: the allocator (its live heap by call stack, ' +
      'its free resident pages by size class, the rest), the program\u2019s own mappings, stacks, static data, and dark memory: what no owner explains. ' +
      'Click a process to show it below.' }));
  const treeCanvas = el('canvas', { id: 'treemap' });
  treeSection.append(treeCanvas);
  document.body.append(treeSection);

  /** The process's resident anonymous memory and swap by owner; inside the allocator, the live
   * heap by call stack, the free resident pages by size class, and the rest (headers, pages a
   * block only partly covers). Live bytes not resident (untouched) are left out of the box. */
  function ownerTree(p) {
    const m = p.memory || {};
    const alloc = m.allocator_resident_bytes || 0;
    const free = typeof m.allocator_free_resident_bytes === 'number' ? m.allocator_free_resident_bytes : 0;
    const stacks = (p.stacks || []).filter(s => s.live_bytes > 0).sort((a, b) => b.live_bytes - a.live_bytes);
    const stackTotal = stacks.reduce((sum, s) => sum + s.live_bytes, 0);
    const live = Math.max(m.heap_live_bytes || 0, stackTotal);
    const shown = Math.min(live, Math.max(0, alloc - free));
    const scale = live > 0 ? shown / live : 0;
    const heap = { name: 'heap live', color: LEVEL_COLORS.heap_live_bytes, value: shown, children: [] };
    for (const s of stacks.slice(0, 40)) heap.children.push({ name: frameName(s.frame_ids[0]), stack: s.frame_ids, color: flameColor(frameName(s.frame_ids[0])), value: s.live_bytes * scale });
    const rest = stacks.slice(40).reduce((sum, s) => sum + s.live_bytes, 0) * scale;
    if (rest > 0) heap.children.push({ name: (stacks.length - 40) + ' other stacks', color: '#f0c27a', value: rest });
    if (live > stackTotal) heap.children.push({ name: 'no stack recorded', color: '#f6dcae', value: (live - stackTotal) * scale });
    const pool = { name: 'free (resident)', color: LEVEL_COLORS.allocator_free_resident_bytes, value: free,
      children: (m.allocator_free_by_size || []).filter(c => c.resident_bytes > 0).map(c => ({ name: 'gaps of ' + bytes(c.min_bytes) + '+', color: '#c3dfc9', value: c.resident_bytes })) };
    const other = { name: 'headers, partial pages', color: '#e5c89a', value: Math.max(0, alloc - shown - free) };
    const owners = [{ name: LEVEL_NAMES.allocator_resident_bytes, color: LEVEL_COLORS.allocator_resident_bytes, value: alloc,
      children: [heap, pool, other].filter(c => c.value > 0) }];
    for (const key of OWNERS.slice(1)) owners.push({ name: LEVEL_NAMES[key], color: LEVEL_COLORS[key], value: m[key] || 0, dark: key === 'dark_bytes' });
    const kept = owners.filter(o => o.value > 0);
    return { name: label(p), proc: p, color: '#d7d7dc', value: (m.rss_anon_bytes || 0) + (m.swap_bytes || 0), children: kept };
  }

  function levelTree(p) {
    const m = p.memory || {};
    if (hasOwners(m)) return ownerTree(p);
    const stacks = (p.stacks || []).filter(s => s.live_bytes > 0).sort((a, b) => b.live_bytes - a.live_bytes);
    const stackTotal = stacks.reduce((sum, s) => sum + s.live_bytes, 0);
    const heap = { name: 'heap live', color: LEVEL_COLORS.heap_live_bytes, value: Math.max(m.heap_live_bytes || 0, stackTotal), children: [] };
    const top = stacks.slice(0, 40);
    for (const s of top) heap.children.push({ name: frameName(s.frame_ids[0]), stack: s.frame_ids, color: flameColor(frameName(s.frame_ids[0])), value: s.live_bytes });
    const rest = stacks.slice(40).reduce((sum, s) => sum + s.live_bytes, 0);
    if (rest > 0) heap.children.push({ name: (stacks.length - top.length) + ' other stacks', color: '#f0c27a', value: rest });
    if (heap.value > stackTotal) heap.children.push({ name: 'no stack recorded', color: '#f6dcae', value: heap.value - stackTotal });
    const levels = [heap];
    for (const key of ['heap_overhead_bytes', 'mapped_anon_bytes', 'dark_bytes', 'rss_file_bytes', 'rss_shmem_bytes']) {
      levels.push({ name: LEVEL_NAMES[key], color: LEVEL_COLORS[key], value: m[key] || 0, dark: key === 'dark_bytes' });
    }
    const subsystems = Object.entries(p.subsystems || {}).filter(([, v]) => v > 0);
    if (subsystems.length) {
      levels.push({ name: LEVEL_NAMES.subsystems, color: LEVEL_COLORS.subsystems, value: subsystems.reduce((s, [, v]) => s + v, 0),
        children: subsystems.map(([name, v]) => ({ name: name, color: '#e88b8b', value: v })) });
    }
    const kept = levels.filter(l => l.value > 0);
    return { name: label(p), proc: p, color: '#d7d7dc', value: kept.reduce((s, l) => s + l.value, 0), children: kept };
  }

  /** Squarified treemap layout (Bruls et al.): items sorted by value, most first. */
  function squarify(items, x, y, w, h, out) {
    const total = items.reduce((s, it) => s + it.value, 0);
    if (total <= 0 || w <= 0 || h <= 0) return;
    const scale = w * h / total;
    const areas = items.map(it => it.value * scale);
    let start = 0;
    while (start < items.length) {
      const side = Math.min(w, h);
      let end = start + 1, sum = areas[start], best = worst(areas[start], areas[start], sum, side);
      while (end < items.length) {
        const nextSum = sum + areas[end];
        const next = worst(areas[start], areas[end], nextSum, side);
        if (next > best) break;
        best = next; sum = nextSum; end++;
      }
      if (w >= h) {
        const cw = sum / h;
        let cy = y;
        for (let i = start; i < end; i++) { const ch = areas[i] / cw; out.push([items[i], x, cy, cw, ch]); cy += ch; }
        x += cw; w -= cw;
      } else {
        const rh = sum / w;
        let cx = x;
        for (let i = start; i < end; i++) { const cw = areas[i] / rh; out.push([items[i], cx, y, cw, rh]); cx += cw; }
        y += rh; h -= rh;
      }
      start = end;
    }
  }
  function worst(largest, smallest, sum, side) {
    const s2 = side * side, sum2 = sum * sum;
    return Math.max(s2 * largest / sum2, sum2 / (s2 * smallest));
  }

  let treeRects = [];
  function drawTreemap() {
    const roots = PROCS.map(levelTree).filter(t => t.value > 0).sort((a, b) => b.value - a.value);
    report.treemap = roots.slice(0, 20).map(r => ({ name: r.name, value: r.value,
      children: r.children.map(c => ({ name: c.name, value: c.value,
        children: (c.children || []).map(k => ({ name: k.name, value: k.value, children: (k.children || []).map(g => g.name) })) })) }));
    const w = contentWidth(treeSection), h = Math.round(Math.min(560, Math.max(260, w * 0.42)));
    const ctx = sizeCanvas(treeCanvas, w, h);
    treeRects = [];
    if (!roots.length) {
      ctx.fillStyle = '#6b6b70';
      ctx.fillText('No memory levels were read.', 10, 14);
      return;
    }
    const place = (items, x, y, cw, ch, depth, root) => {
      const laid = [];
      squarify(items, x, y, cw, ch, laid);
      for (const [item, ix, iy, iw, ih] of laid) {
        if (iw < 1 || ih < 1) continue;
        ctx.fillStyle = item.color;
        ctx.fillRect(ix, iy, iw, ih);
        ctx.strokeStyle = depth === 0 ? '#555' : '#fff';
        ctx.lineWidth = depth === 0 ? 1.5 : 1;
        ctx.strokeRect(ix + 0.5, iy + 0.5, iw - 1, ih - 1);
        const proc = root || item.proc;
        treeRects.push({ item, proc, x: ix, y: iy, w: iw, h: ih, depth });
        const title = fitText(ctx, item.name + ' ' + bytes(item.value), iw);
        const head = depth < 2 && item.children && iw > 40 && ih > 34 ? 15 : 0;
        if (title && ih > 14) {
          ctx.fillStyle = item.dark ? '#fff' : '#111';
          ctx.fillText(title, ix + 3, iy + 8);
        }
        if (item.children && item.children.length && iw > 8 && ih > head + 8) {
          const kids = item.children.slice().sort((a, b) => b.value - a.value);
          place(kids, ix + 2, iy + 2 + head, iw - 4, ih - 4 - head, depth + 1, proc);
        }
      }
    };
    place(roots, 0, 0, w, h, 0, null);
  }
  treeCanvas.addEventListener('mousemove', event => {
    const r = treeCanvas.getBoundingClientRect();
    const x = event.clientX - r.left, y = event.clientY - r.top;
    let hit = null;
    for (const rect of treeRects) if (x >= rect.x && x < rect.x + rect.w && y >= rect.y && y < rect.y + rect.h) hit = rect;
    if (!hit) return hideTip();
    let text = label(hit.proc) + (hit.depth > 0 ? '\n' + hit.item.name : '') + '\n' + bytes(hit.item.value);
    if (hit.item.stack) text += '\n' + hit.item.stack.slice(0, 12).map(frameName).join('\n  \u2190 ');
    showTip(event, text);
  });
  treeCanvas.addEventListener('mouseleave', hideTip);
  treeCanvas.addEventListener('click', event => {
    const r = treeCanvas.getBoundingClientRect();
    const x = event.clientX - r.left, y = event.clientY - r.top;
    const hit = treeRects.find(rect => rect.depth === 0 && x >= rect.x && x < rect.x + rect.w && y >= rect.y && y < rect.y + rect.h);
    if (hit) choose(PROCS.indexOf(hit.proc));
  });

  // ---- the chosen process ----
  const procView = el('section');
  document.body.append(procView);
  const flameTrees = new Map();

  function choose(index) {
    if (index < 0) return;
    if (processRows.has(chosen)) processRows.get(chosen).classList.remove('chosen');
    chosen = index;
    if (processRows.has(chosen)) processRows.get(chosen).classList.add('chosen');
    renderProcess(PROCS[index]);
  }

  function renderProcess(p) {
    redraws.length = 0;
    procView.replaceChildren(el('h2', { text: label(p) + (p.exited ? ', exited' : '') }),
      el('p', { class: 'note', text: 'allocator: ' + (p.allocator_kind || '?') + ' (' + p.allocator + ')' }));
    const m = p.memory || {};
    const figures = [
      ['allocations', count(p.allocations)], ['allocated', bytes(p.allocated_bytes)], ['frees', count(p.frees)],
      ['freed', bytes(p.freed_bytes)], ['live blocks', count(p.live_allocations)], ['heap live', bytes(p.live_bytes)],
      ['heap peak', bytes(p.peak_live_bytes)], ['temporary', count(p.temporary_allocations) + ' (' + bytes(p.temporary_bytes) + ')'],
      ['untracked frees', count(p.untracked_frees)], ['failed allocations', count(p.failed_allocations)],
      ['lost events', count(p.lost_events)], ['RSS', bytes(p.rss_bytes)],
    ];
    for (const key of ['rss_anon_bytes', 'rss_file_bytes', 'rss_shmem_bytes', 'swap_bytes', 'allocator_held_bytes', 'heap_overhead_bytes', 'mapped_anon_bytes'].concat(hasOwners(m) ? OWNERS.concat(['allocator_free_resident_bytes']) : ['dark_bytes'])) {
      figures.push([LEVEL_NAMES[key], m[key] === null ? 'unknown' : bytes(m[key])]);
    }
    for (const [name, v] of Object.entries(p.subsystems || {})) figures.push(['subsystem ' + name, bytes(v)]);
    procView.append(el('div', { class: 'figures' }, ...figures.map(([k, v]) => el('div', null, el('span', { text: k }), el('span', { text: v })))));
    const words = freeWords(p);
    if (words) procView.append(el('p', { class: 'warn', text: words.charAt(0).toUpperCase() + words.slice(1) + '.' }));
    renderTimeline(p);
    renderFlamegraph(p);
    renderPeak(p);
    renderLeaks(p);
    renderTemporary(p);
    renderFunctions(p);
  }

  // ---- timeline ----
  function renderTimeline(p) {
    procView.append(el('h3', { text: 'Timeline' }));
    const points = p.timeline || [];
    if (!points.length) { procView.append(el('p', { class: 'note', text: 'No samples were kept for this process.' })); return; }
    const series = [];
    // The owners stacked (they add up to RSS anonymous + swap), the other levels as lines.
    const owned = points.some(pt => hasOwners(pt.memory));
    const stacked = owned ? OWNERS : [];
    const lines = owned ? ['heap_live_bytes', 'allocator_held_bytes', 'rss_file_bytes', 'rss_shmem_bytes']
      : ['rss_anon_bytes', 'rss_file_bytes', 'heap_live_bytes', 'allocator_held_bytes', 'mapped_anon_bytes', 'dark_bytes', 'swap_bytes', 'rss_shmem_bytes'];
    for (const key of stacked.concat(lines)) {
      const values = points.map(pt => (pt.memory || {})[key] || 0);
      if (values.some(v => v > 0)) series.push({ name: LEVEL_NAMES[key], color: LEVEL_COLORS[key], values, on: true, stacked: stacked.includes(key) });
    }
    const names = new Set();
    for (const pt of points) for (const name in pt.subsystems || {}) names.add(name);
    for (const name of names) {
      series.push({ name: 'subsystem ' + name, color: flameColor('sub' + name), dashed: true, on: true,
        values: points.map(pt => (pt.subsystems || {})[name] || 0) });
    }
    if (!series.length) {
      procView.append(el('p', { class: 'note', text: 'Every level read zero at every sample.' }));
      series.push({ name: LEVEL_NAMES.heap_live_bytes, color: LEVEL_COLORS.heap_live_bytes, values: points.map(() => 0), on: true });
    }
    const legend = el('div', { class: 'legend' });
    const canvas = el('canvas', { id: 'timeline' });
    procView.append(legend, canvas);
    for (const s of series) {
      const button = el('button', { onclick: () => { s.on = !s.on; button.classList.toggle('off', !s.on); draw(); } }, el('i', { style: 'background:' + s.color }), s.name);
      legend.append(button);
    }
    const pad = { left: 70, right: 12, top: 10, bottom: 24 };
    let w = 0, h = 240, xs = [], maxY = 1;
    const t0 = points[0].ts_us, t1 = points[points.length - 1].ts_us;
    const xOf = ts => pad.left + (t1 > t0 ? (ts - t0) / (t1 - t0) : 0.5) * (w - pad.left - pad.right);
    const yOf = v => h - pad.bottom - (v / maxY) * (h - pad.top - pad.bottom);
    function draw() {
      w = contentWidth(procView);
      const ctx = sizeCanvas(canvas, w, h);
      // A stacked series is drawn on top of the ones before it: its tops are the running sums.
      let base = points.map(() => 0);
      for (const s of series) {
        s.bottoms = base;
        s.tops = s.stacked && s.on ? s.values.map((v, i) => base[i] + v) : s.values;
        if (s.stacked && s.on) base = s.tops;
      }
      maxY = Math.max(1, ...series.filter(s => s.on).map(s => Math.max(...s.tops)));
      ctx.strokeStyle = '#e4e4e8'; ctx.fillStyle = '#6b6b70'; ctx.lineWidth = 1;
      for (let i = 0; i <= 4; i++) {
        const v = maxY * i / 4, y = yOf(v);
        ctx.beginPath(); ctx.moveTo(pad.left, y); ctx.lineTo(w - pad.right, y); ctx.stroke();
        ctx.textAlign = 'right'; ctx.fillText(bytes(Math.round(v)), pad.left - 6, y);
      }
      ctx.textAlign = 'center';
      for (let i = 0; i <= 5; i++) {
        const ts = t0 + (t1 - t0) * i / 5;
        ctx.fillText(((ts) / 1e6).toFixed(2) + ' s', xOf(ts), h - pad.bottom + 12);
      }
      ctx.textAlign = 'left';
      xs = points.map(pt => xOf(pt.ts_us));
      for (const s of series.filter(s => s.on && s.stacked)) {
        ctx.fillStyle = s.color; ctx.globalAlpha = 0.75;
        ctx.beginPath();
        s.tops.forEach((v, i) => (i ? ctx.lineTo(xs[i], yOf(v)) : ctx.moveTo(xs[i], yOf(v))));
        for (let i = xs.length - 1; i >= 0; i--) ctx.lineTo(xs[i], yOf(s.bottoms[i]));
        ctx.closePath(); ctx.fill();
        if (points.length === 1) ctx.fillRect(xs[0] - 4, yOf(s.tops[0]), 8, yOf(s.bottoms[0]) - yOf(s.tops[0]));
        ctx.globalAlpha = 1;
      }
      for (const s of series.filter(s => s.on && !s.stacked)) {
        ctx.strokeStyle = s.color; ctx.fillStyle = s.color; ctx.lineWidth = 1.6;
        ctx.setLineDash(s.dashed ? [5, 3] : []);
        ctx.beginPath();
        s.values.forEach((v, i) => (i ? ctx.lineTo(xs[i], yOf(v)) : ctx.moveTo(xs[i], yOf(v))));
        ctx.stroke();
        if (points.length === 1) { ctx.beginPath(); ctx.arc(xs[0], yOf(s.values[0]), 3, 0, 7); ctx.fill(); }
      }
      ctx.setLineDash([]);
    }
    canvas.addEventListener('mousemove', event => {
      const x = event.clientX - canvas.getBoundingClientRect().left;
      let best = 0;
      for (let i = 1; i < xs.length; i++) if (Math.abs(xs[i] - x) < Math.abs(xs[best] - x)) best = i;
      showTip(event, (points[best].ts_us / 1e6).toFixed(3) + ' s\n' + series.filter(s => s.on).map(s => s.name + ': ' + bytes(s.values[best])).join('\n'));
    });
    canvas.addEventListener('mouseleave', hideTip);
    draw();
    redraws.push(draw);
  }

  // ---- flamegraphs ----
  const METRICS = [
    ['live_bytes', 'live bytes'], ['allocated_bytes', 'allocated bytes'], ['temporary_bytes', 'temporary bytes'],
  ];
  /** Merges every stack of a process into one tree, outermost frame first. */
  function flameTree(p, metric) {
    const key = p.pid + '/' + PROCS.indexOf(p) + '/' + metric;
    if (flameTrees.has(key)) return flameTrees.get(key);
    const root = { id: -1, v: 0, c: null, parent: null, kids: null };
    for (const s of p.stacks || []) {
      const v = s[metric];
      if (!(v > 0)) continue;
      root.v += v;
      let node = root;
      const ids = s.frame_ids;
      for (let i = ids.length - 1; i >= 0; i--) {
        if (!node.c) node.c = new Map();
        let child = node.c.get(ids[i]);
        if (!child) { child = { id: ids[i], v: 0, c: null, parent: node, kids: null }; node.c.set(ids[i], child); }
        child.v += v;
        node = child;
      }
    }
    flameTrees.set(key, root);
    return root;
  }
  function kids(node) {
    if (!node.kids) node.kids = node.c ? Array.from(node.c.values()).sort((a, b) => b.v - a.v) : [];
    return node.kids;
  }

  function renderFlamegraph(p) {
    procView.append(el('h3', { text: 'Flamegraph' }));
    if (!(p.stacks || []).length) { procView.append(el('p', { class: 'note', text: 'No call stacks were recorded (--no-stacks, or nothing allocated).' })); return; }
    const ROW = 17;
    const tabs = el('div', { class: 'tabs', id: 'flamegraph-metrics' });
    const canvas = el('canvas', { id: 'flamegraph' });
    const note = el('span', { class: 'note' });
    procView.append(tabs, el('p', { class: 'note', text: 'Outermost frame on top, callees below; width is bytes. Click a frame to zoom, the top bar to zoom out.' }), canvas);
    let metric = 'live_bytes', root = null, zoom = null, rects = [];
    const buttons = METRICS.map(([m, name]) => el('button', { class: m === metric ? 'on' : '', onclick: () => { metric = m; root = null; buttons.forEach((b, i) => b.classList.toggle('on', METRICS[i][0] === m)); draw(); } }, name));
    tabs.append(...buttons, note);
    const rootName = () => label(p) + ': all stacks';
    function draw() {
      if (!root) { root = flameTree(p, metric); zoom = root; }
      const w = contentWidth(procView);
      rects = [];
      const path = [];
      for (let n = zoom; n; n = n.parent) path.unshift(n);
      path.forEach((n, d) => rects.push({ n, x: 0, w, d }));
      let maxDepth = path.length - 1;
      const walk = (node, x, width, d) => {
        let cx = x;
        for (const k of kids(node)) {
          const kw = width * k.v / node.v;
          if (kw >= 1) {
            rects.push({ n: k, x: cx, w: kw, d: d + 1 });
            if (d + 1 > maxDepth) maxDepth = d + 1;
            walk(k, cx, kw, d + 1);
          }
          cx += kw;
        }
      };
      if (zoom.v > 0) walk(zoom, 0, w, path.length - 1);
      const ctx = sizeCanvas(canvas, w, (maxDepth + 1) * ROW + 1);
      for (const r of rects) {
        const name = r.n.id < 0 ? rootName() : frameName(r.n.id);
        ctx.fillStyle = r.n.id < 0 ? '#c9c9d1' : r.d < path.length - 1 ? '#dedee4' : flameColor(name);
        ctx.fillRect(r.x, r.d * ROW, Math.max(r.w - 0.5, 0.5), ROW - 1);
        const text = r.w > 30 ? fitText(ctx, name, r.w) : '';
        if (text) { ctx.fillStyle = '#111'; ctx.fillText(text, r.x + 3, r.d * ROW + ROW / 2); }
      }
      note.textContent = root.v > 0 ? bytes(root.v) + ' in all; ' + rects.length + ' frames drawn' : 'nothing to show for ' + metric.replace('_', ' ');
      report.flameFrames = rects.length;
      report.flameMetric = metric;
      report.flameZoom = zoom.id < 0 ? rootName() : frameName(zoom.id);
    }
    const at = event => {
      const r = canvas.getBoundingClientRect();
      const x = event.clientX - r.left, d = Math.floor((event.clientY - r.top) / ROW);
      return rects.find(rect => rect.d === d && x >= rect.x && x < rect.x + rect.w);
    };
    canvas.addEventListener('mousemove', event => {
      const hit = at(event);
      if (!hit) return hideTip();
      const n = hit.n;
      const own = n.v - kids(n).reduce((s, k) => s + k.v, 0);
      showTip(event, (n.id < 0 ? rootName() : frameName(n.id) + '\n' + frameWhere(n.id)) + '\n' + bytes(n.v) + ' (' + percent(n.v, root.v) +
        ' of all, ' + percent(n.v, zoom.v) + ' of the zoomed frame)\nin the function itself: ' + bytes(own));
    });
    canvas.addEventListener('mouseleave', hideTip);
    canvas.addEventListener('click', event => {
      const hit = at(event);
      if (hit) { zoom = hit.n; draw(); }
    });
    draw();
    redraws.push(draw);
  }

  // ---- tables ----
  function renderPeak(p) {
    procView.append(el('h3', { text: 'Heap peak' }));
    if (!p.peak) {
      procView.append(el('p', { class: 'note', text: 'The highest live heap was ' + bytes(p.peak_live_bytes) + '; the stacks that held it were not recorded.' }));
      return;
    }
    procView.append(el('p', { class: 'note', text: 'The live heap was highest at ' + bytes(p.peak.live_bytes) + ', ' + seconds(p.peak.at_s) +
      ' into the run (at sample resolution; the exact highest figure is ' + bytes(p.peak_live_bytes) + '). The stacks that held it then:' }));
    procView.append(table(['live bytes', 'blocks', 'share', '~allocated by'], p.peak.stacks.slice(0, 100).map(s =>
      el('tr', null, el('td', { text: bytes(s.live_bytes) }), el('td', { text: count(s.live_allocations) }),
        el('td', { text: percent(s.live_bytes, p.peak.live_bytes) }), stackCell(s.frame_ids)))));
  }
  function renderLeaks(p) {
    procView.append(el('h3', { text: 'Leaks' }));
    const leaks = (p.stacks || []).filter(s => s.leaked_bytes > 0).sort((a, b) => b.leaked_bytes - a.leaked_bytes);
    if (!leaks.length) {
      procView.append(el('p', { class: 'note', text: (p.stacks || []).length ? 'No stack holds leaked bytes.' : 'No call stacks were recorded.' }));
      return;
    }
    const total = leaks.reduce((s, l) => s + l.leaked_bytes, 0);
    procView.append(el('p', { class: 'note', text: count(leaks.length) + (leaks.length === 1 ? ' stack holds ' : ' stacks hold ') + bytes(total) + ' still live at the end' + (leaks.length > 200 ? '; the 200 largest:' : ':') }));
    procView.append(table(['bytes', 'blocks', 'oldest', '~allocated by'], leaks.slice(0, 200).map(s =>
      el('tr', null, el('td', { text: bytes(s.leaked_bytes) }), el('td', { text: count(s.leaked_allocations) }),
        el('td', { text: s.oldest_age_s !== undefined ? seconds(s.oldest_age_s) : '-' }), stackCell(s.frame_ids)))));
  }
  function renderTemporary(p) {
    procView.append(el('h3', { text: 'Temporary allocations' }));
    procView.append(el('p', { class: 'note', text: count(p.temporary_allocations) + ' of ' + count(p.allocations) + ' allocations (' +
      percent(p.temporary_allocations, p.allocations) + ', ' + bytes(p.temporary_bytes) + ') were freed before their thread allocated anything else.' }));
    const stacks = (p.stacks || []).filter(s => s.temporary_allocations > 0).sort((a, b) => b.temporary_allocations - a.temporary_allocations);
    if (!stacks.length) return;
    procView.append(table(['temporary', 'bytes', 'of its allocations', '~allocated by'], stacks.slice(0, 100).map(s =>
      el('tr', null, el('td', { text: count(s.temporary_allocations) }), el('td', { text: bytes(s.temporary_bytes) }),
        el('td', { text: percent(s.temporary_allocations, s.allocations) }), stackCell(s.frame_ids)))));
  }
  function renderFunctions(p) {
    const functions = (p.functions || []).slice(0, 50);
    if (!functions.length) return;
    procView.append(el('h3', { text: 'Functions' }), el('p', { class: 'note', text: 'Inclusive: anywhere on the stack; exclusive: called the allocator itself.' }));
    procView.append(table(['~function', 'live incl.', 'live excl.', 'allocated incl.', 'allocated excl.'], functions.map(f =>
      el('tr', null, el('td', { class: 'text', text: f.name }), el('td', { text: bytes(f.live_inclusive_bytes) }), el('td', { text: bytes(f.live_exclusive_bytes) }),
        el('td', { text: bytes(f.allocated_inclusive_bytes) }), el('td', { text: bytes(f.allocated_exclusive_bytes) })))));
  }

  // ---- start ----
  const redraws = [];
  // What the page drew, for a person in the console and for memtrace's tests.
  const report = { ready: false, processes: PROCS.length, flameFrames: 0, flameMetric: '', flameZoom: '', ms: 0, treemap: [] };
  window.memtraceReport = report;
  drawTreemap();
  if (chosen >= 0) choose(chosen);
  else procView.append(el('p', { class: 'note', text: 'No process was traced.' }));
  let pending = false;
  window.addEventListener('resize', () => {
    if (pending) return;
    pending = true;
    requestAnimationFrame(() => {
      pending = false;
      drawTreemap();
      redraws.forEach(draw => draw());
    });
  });
  report.ms = Math.round(performance.now() - started);
  report.ready = true;
})();
