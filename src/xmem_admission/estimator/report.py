"""``xmem estimate --report OUT.html`` and ``--plot OUT.png``: the peak explained, drawn.

The HTML report is one self-contained page (its script and styles inline, nothing fetched): the
first GPU's allocated memory over the trace stacked by category, each GPU's reserved memory,
capacity and recommended request as lines, optimizer steps and forward / backward / optimizer
phases shaded, the peak's table per GPU (``peak.explain``) and what would change the estimate
(``peak.alternatives``). Hovering the timeline names the allocation made there.

Its size is bounded whatever the trace's length: the timeline is cut into at most ``POINTS``
buckets, each kept by its sample of most allocated memory (reserved lines: most reserved), and
each GPU's peak event is always one of the samples, exactly. The page sets
``data-drawn="yes"`` on ``<body>`` only once its script has drawn everything (the test waits on
it).
"""

from __future__ import annotations

import html
import json
from typing import Any, Dict, List, Optional, Sequence, Tuple

from xmem_admission.contract import gpus as catalogue
from xmem_admission.estimator.allocator.alloc_conf import AllocatorConfig
from xmem_admission.estimator.allocator.caching import CachingAllocator
from xmem_admission.estimator.allocator.simulate import simulate
from xmem_admission.estimator.estimate import allocator_room, range_lines
from xmem_admission.estimator.orchestrate import for_gpu
from xmem_admission.estimator.peak import Explained, catalogue_request, display_module
from xmem_admission.estimator.trace import ALLOC, FREE, MARK, Category, Trace, note_groups

POINTS = 1500  # timeline samples kept per series, whatever the trace's length
PHASES = ("forward", "loss", "backward", "optimizer")
CATEGORIES = [c.value for c in Category]


def _origins(trace: Trace, stream: Trace) -> List[int]:
    """For each event of a GPU's stream, the index of the trace event it is or follows
    (``for_gpu`` keeps the trace's own event objects and inserts workspaces after marks)."""
    out = []
    source = trace.events
    i = -1
    for e in stream.events:
        if i + 1 < len(source) and e is source[i + 1]:
            i += 1
        out.append(max(i, 0))
    return out


def _label(e: Any) -> str:
    module = display_module(e.module)
    return f"{e.size / 2**20:,.1f} MiB {e.category} in {module}" + (
        f" by {e.source}" if e.source else (f" ({e.phase})" if e.phase else ""))


def timeline(trace: Trace, gpu: catalogue.GPU, config: AllocatorConfig,
             points: int = POINTS) -> Dict[str, Any]:
    """One GPU's timeline, downsampled: x (trace event index), allocated bytes per category,
    reserved bytes, the allocation each sample names, and the peak's sample (exact)."""
    stream = for_gpu(trace, gpu)
    sim = simulate(stream, config, capacity_bytes=allocator_room(trace, stream, gpu),
                   timeline=True)
    reserved_at = {index: reserved for index, _, reserved in sim.timeline or []}
    origin = _origins(trace, stream)
    rounding = CachingAllocator(config)
    sums = dict.fromkeys(CATEGORIES, 0)
    live: Dict[int, Tuple[str, int]] = {}
    samples: List[Tuple[int, int, Dict[str, int], int, str]] = []  # x, total, sums, reserved
    reserved = total = 0
    last = -1 if sim.oom is None else sim.oom.event_index
    for index, e in enumerate(stream.events):
        if last >= 0 and index >= last:
            break
        if e.op == ALLOC and e.size:
            size = rounding.round_size(e.size)
            category = e.category if e.category in sums else Category.OTHER.value
            live[e.id] = (category, size)
            sums[category] += size
            total += size
        elif e.op == FREE and e.id in live:
            category, size = live.pop(e.id)
            sums[category] -= size
            total -= size
        else:
            continue
        reserved = reserved_at.get(index, reserved)
        samples.append((origin[index], total, dict(sums), reserved,
                        _label(e) if e.op == ALLOC else "free",))
        if index == sim.peak_reserved_event:
            peak_sample = len(samples) - 1
    if not samples:
        return {"gpu": gpu.key, "x": [], "stacks": {}, "reserved": [], "labels": [], "peak": -1}
    peak_at = locals().get("peak_sample", max(range(len(samples)), key=lambda i: samples[i][3]))
    kept = _downsample(samples, points, peak_at)
    return {"gpu": gpu.key,
            "x": [samples[i][0] for i in kept],
            "stacks": {c: [samples[i][2][c] for i in kept] for c in CATEGORIES
                       if any(samples[i][2][c] for i in kept)},
            "reserved": [samples[i][3] for i in kept],
            "labels": [samples[i][4] for i in kept],
            "peak": kept.index(peak_at)}


def _downsample(samples: Sequence[Tuple[int, int, Dict[str, int], int, str]], points: int,
                peak: int) -> List[int]:
    """At most ``points`` + 1 sample indices: per bucket the one of most allocated memory, and
    the bucket's most reserved too when that is another; the peak always."""
    n = len(samples)
    if n <= points:
        return list(range(n))
    step = n / (points // 2)
    kept = {peak}
    start = 0
    while start < n:
        end = min(n, int(start + step) + 1)
        bucket = range(start, end)
        kept.add(max(bucket, key=lambda i: samples[i][1]))
        kept.add(max(bucket, key=lambda i: samples[i][3]))
        start = end
    return sorted(kept)


def phases(trace: Trace) -> Tuple[List[List[Any]], List[int]]:
    """[start, end, phase] spans of the trace's forward, loss, backward and optimizer phases
    (by its allocations), and the event index of each optimizer step's end."""
    spans: List[List[Any]] = []
    steps: List[int] = []
    current: Optional[List[Any]] = None
    for index, e in enumerate(trace.events):
        if e.op == MARK and e.label.startswith("step "):
            steps.append(index)
            continue
        if e.op != ALLOC:
            continue
        phase = e.phase if e.phase in PHASES else ""
        if current is not None and current[2] == phase:
            current[1] = index
            continue
        if current is not None and current[2]:
            spans.append(current)
        current = [index, index, phase]
    if current is not None and current[2]:
        spans.append(current)
    return spans, steps


def _gib(n: Optional[int]) -> str:
    return "-" if n is None else f"{n / 2**30:.2f} GiB"


def _signed(n: int) -> str:
    return f"{n / 2**30:+.2f} GiB"


def _table(head: Sequence[str], rows: Sequence[Sequence[Any]], cls: str = "") -> str:
    out = [f'<table class="{cls}"><tr>' + "".join(f"<th>{html.escape(h)}</th>" for h in head)
           + "</tr>"]
    for row in rows:
        out.append("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>")
    return "".join(out) + "</table>"


def page(trace: Trace, est: Any, explained: Explained, config: AllocatorConfig,
         command: str = "", points: int = POINTS) -> str:
    """The report's HTML."""
    by_key = {g.key: g for g in catalogue.all_gpus()}
    lines = [timeline(trace, by_key[g.gpu], config, points) for g in est.gpus]
    spans, steps = phases(trace)
    data = {"timelines": lines, "phases": spans, "steps": steps,
            "gpus": [{"gpu": g.gpu, "capacity": g.capacity_bytes,
                      "request": g.recommended_request_bytes,
                      "overhead": g.total_bytes - g.peak_reserved_bytes}
                     for g in est.gpus],
            "categories": CATEGORIES, "events": len(trace.events)}
    summary = _table(("GPU", "capacity", "peak reserved", "total", "recommended request",
                      "fits", "MIG profile"),
                     [(g.gpu, _gib(g.capacity_bytes), _gib(g.peak_reserved_bytes),
                       _gib(g.total_bytes), _gib(g.recommended_request_bytes),
                       g.fit if g.fit != "fits" else "yes", g.mig_profile or "-")
                      for g in est.gpus],
                     "summary")
    ranged = range_lines(est.gpus)
    if ranged:
        summary += ("<p class=\"note\"><b>the range of the estimate</b></p><ul>"
                    + "".join(f"<li>{html.escape(line.strip())}</li>" for line in ranged)
                    + "</ul>")
    for heading, items in note_groups(getattr(est, "notes", [])):
        summary += (f"<p class=\"note\"><b>{html.escape(heading)}</b></p><ul>"
                    + "".join(f"<li>{html.escape(item)}</li>" for item in items) + "</ul>")
    peaks = []
    for p in explained.peaks:
        rows: List[Tuple[Any, ...]] = [(display_module(g.module), g.category,
                                        ", ".join(g.ops) or g.op, _gib(g.bytes), g.blocks)
                                       for g in p.groups]
        if p.rest_groups:
            rows.append((f"({p.rest_groups} more groups)", "", "", _gib(p.rest_bytes), ""))
        rows.append(("cached but free", "allocator cache", "", _gib(p.cached_free_bytes), ""))
        rows.append(("of which in split segments", "fragmentation", "",
                     _gib(p.fragmentation_bytes), ""))
        where = f"{p.phase or 'setup'} of step {p.step + 1}, event {p.event}"
        peaks.append(f'<h3>{html.escape(p.gpu)}: {_gib(p.reserved_bytes)} reserved at the '
                     f'peak ({html.escape(where)})</h3>'
                     + _table(("module", "category", "op", "size", "blocks"), rows, "peak"))
    alt = explained.alternatives
    alternatives = [_table(("GPU", "with expandable_segments:True", "change", "request"),
                           [(e["gpu"], _gib(e["total_bytes"]), _signed(-e["saves_bytes"]),
                             _gib(e["recommended_request_bytes"]))
                            for e in alt.expandable_segments]),
                    _table(("GPU", "total", "margin", "request", "MIG slice"),
                           [(r["gpu"], _gib(r["total_bytes"]), _gib(r["margin_bytes"]),
                             _gib(r["recommended_request_bytes"]),
                             f"{r['mig_profile']} ({_gib(r['mig_slice_bytes'])})"
                             if r["mig_profile"] else "-") for r in alt.requests])]
    if alt.catalogue:
        alternatives.append(_table(("catalogue GPU", "capacity", "total", "request", "fits"),
                                   [(c["gpu"], _gib(c["capacity_bytes"]),
                                     f"out of memory past {_gib(c['total_bytes'])}"
                                     if c["out_of_memory"] else _gib(c["total_bytes"]),
                                     catalogue_request(c),
                                     "yes" if c["fits"] else "no") for c in alt.catalogue]))
    dom = alt.dominant_activations
    if dom:
        alternatives.append(
            f"<p>Activations at the peak are dominated by <b>{html.escape(dom['module'])}</b>: "
            f"{_gib(dom['bytes'])}, {100 * dom['share']:.0f}% of the allocated peak. Activation "
            f"checkpointing there, or a smaller batch, shrinks them; the trace cannot say by "
            f"how much.</p>")
    title = f"xmem: the peak explained ({len(est.gpus)} GPU model(s))"
    return (_TEMPLATE
            .replace("@TITLE@", html.escape(title))
            .replace("@COMMAND@", html.escape(command or " ".join(trace.meta.get("command") or [])))
            .replace("@META@", html.escape(f"mode {est.mode}, {est.steps} steps, torch "
                                           f"{est.torch}, {len(trace.events):,} events"))
            .replace("@SUMMARY@", summary)
            .replace("@PEAKS@", "".join(peaks))
            .replace("@ALTERNATIVES@", "".join(alternatives))
            .replace("@DATA@", json.dumps(data, separators=(",", ":")).replace("</", "<\\/")))


def write(path: str, trace: Trace, est: Any, explained: Explained, config: AllocatorConfig,
          command: str = "") -> None:
    from xmem_admission.contract.errors import EstimateError

    try:
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(page(trace, est, explained, config, command))
    except OSError as exc:
        raise EstimateError(f"--report {path}: cannot write: {exc}") from None


# Colours per category and phase: one palette for the page and the PNG.
COLOURS = {"parameter": "#4e79a7", "gradient": "#f28e2b", "optimizer_state": "#e15759",
           "activation": "#76b7b2", "temporary": "#59a14f", "input": "#edc948",
           "workspace": "#b07aa1", "communication": "#ff9da7", "other": "#9c755f"}
PHASE_COLOURS = {"forward": "#dbe9f6", "loss": "#f6f0db", "backward": "#f6dbe0",
                 "optimizer": "#e3f6db"}
LINE_STYLES = ("-", "--", "-.", ":")


def plot(plt: Any, path: str, trace: Trace, est: Any, config: AllocatorConfig,
         explained: Optional[Explained] = None) -> None:
    """``--plot``: one panel per GPU (allocated stacked by category, reserved, capacity and
    request lines), phases shaded and steps marked."""
    by_key = {g.key: g for g in catalogue.all_gpus()}
    peaks = {p.gpu: p for p in explained.peaks} if explained is not None else {}
    spans, steps = phases(trace)
    fig, axes = plt.subplots(len(est.gpus), 1, figsize=(11, 3.2 * len(est.gpus)), sharex=True,
                             squeeze=False)
    for ax, g in zip(axes[:, 0], est.gpus):
        line = timeline(trace, by_key[g.gpu], config)
        for start, end, phase in spans:
            ax.axvspan(start, end, color=PHASE_COLOURS[phase], linewidth=0)
        for index in steps:
            ax.axvline(index, color="#555555", linewidth=0.6)
        if line["x"]:
            names = list(line["stacks"])
            ax.stackplot(line["x"], *[[v / 2**30 for v in line["stacks"][c]] for c in names],
                         labels=names, colors=[COLOURS.get(c, "#999999") for c in names],
                         step="post")
            ax.plot(line["x"], [v / 2**30 for v in line["reserved"]], color="black",
                    linewidth=1, label="reserved", drawstyle="steps-post")
        top = 1.25 * max(g.recommended_request_bytes, g.peak_reserved_bytes) / 2**30
        capacity = g.capacity_bytes / 2**30
        ax.axhline(capacity, color="#d62728", linestyle="--",
                   label=f"capacity {capacity:.1f} GiB" + (" (above)" if capacity > top else ""))
        ax.axhline(g.recommended_request_bytes / 2**30, color="#1f77b4", linestyle=":",
                   label=f"request {g.recommended_request_bytes / 2**30:.2f} GiB")
        if line["x"] and line["peak"] >= 0 and peaks.get(g.gpu) is not None:
            largest = peaks[g.gpu].largest
            x, y = line["x"][line["peak"]], line["reserved"][line["peak"]] / 2**30
            ax.plot([x], [y], "o", color="#d62728")
            if largest is not None:
                ax.annotate(f"peak: largest {display_module(largest.module)} "
                            f"{largest.category} {largest.bytes / 2**30:.2f} GiB", (x, y),
                            xytext=(8, 8), textcoords="offset points", fontsize="small")
        ax.set_title(f"{g.gpu}: total {g.total_bytes / 2**30:.2f} GiB", fontsize="medium")
        ax.set_ylabel("GiB")
        ax.set_ylim(0, max(top, capacity * 1.05) if capacity <= top * 1.5 else top)
        ax.legend(loc="upper left", fontsize="x-small", ncol=3)
    axes[-1, 0].set_xlabel("trace event (steps: grey lines; phases shaded: forward blue, "
                           "loss yellow, backward red, optimizer green)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


_TEMPLATE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>@TITLE@</title>
<script>
window.onerror=function(message,source,line){var h=document.documentElement;
h.setAttribute('data-errors',(h.getAttribute('data-errors')||'')+message+' (line '+line+'); ');};
</script>
<style>
body{font:14px system-ui,sans-serif;margin:1.5em;color:#222}
h1{font-size:1.3em}h2{font-size:1.1em;margin-top:1.5em}h3{font-size:1em}
code{background:#f3f3f3;padding:2px 4px}
table{border-collapse:collapse;margin:.5em 0}td,th{border:1px solid #ccc;padding:3px 8px;
text-align:left}th{background:#f3f3f3}
#chart{border:1px solid #ccc;width:100%;height:420px;display:block}
#tip{position:fixed;pointer-events:none;background:#222;color:#fff;padding:4px 6px;
font-size:12px;border-radius:3px;display:none;max-width:40em}
.legend span{display:inline-block;margin-right:1em}.legend i{display:inline-block;width:10px;
height:10px;margin-right:4px}
</style></head>
<body data-drawn="no">
<h1>@TITLE@</h1>
<p><code>@COMMAND@</code><br>@META@</p>
<h2>Estimate</h2>@SUMMARY@
<h2>Timeline</h2>
<p>Allocated memory on the first GPU stacked by category; each GPU's reserved memory (solid),
capacity (dashed) and recommended request (dotted); optimizer steps as vertical lines, phases
shaded. Hover to name the allocation.</p>
<div class="legend" id="legend"></div>
<canvas id="chart"></canvas><div id="tip"></div>
<h2>At the peak</h2>@PEAKS@
<h2>What would change it</h2>@ALTERNATIVES@
<script id="data" type="application/json">@DATA@</script>
<script>
(function(){
var D=JSON.parse(document.getElementById('data').textContent);
var C={parameter:'#4e79a7',gradient:'#f28e2b',optimizer_state:'#e15759',activation:'#76b7b2',
temporary:'#59a14f',input:'#edc948',workspace:'#b07aa1',communication:'#ff9da7',other:'#9c755f'};
var P={forward:'#dbe9f6',loss:'#f6f0db',backward:'#f6dbe0',optimizer:'#e3f6db'};
var G=['#000000','#d62728','#1f77b4','#2ca02c','#9467bd','#8c564b','#e377c2','#17becf'];
var cv=document.getElementById('chart'),tip=document.getElementById('tip');
var dpr=window.devicePixelRatio||1,W=cv.clientWidth,H=cv.clientHeight;
cv.width=W*dpr;cv.height=H*dpr;var c=cv.getContext('2d');c.scale(dpr,dpr);
var L=70,R=10,T=10,B=30,first=D.timelines[0]||{x:[]};
var xmax=Math.max(1,D.events-1),ymax=1;
D.gpus.forEach(function(g){ymax=Math.max(ymax,g.request);});
D.timelines.forEach(function(t){t.reserved.forEach(function(v){ymax=Math.max(ymax,v);});});
ymax*=1.25;
function X(v){return L+(W-L-R)*v/xmax;}function Y(v){return H-B-(H-T-B)*v/ymax;}
D.phases.forEach(function(p){c.fillStyle=P[p[2]]||'#eee';
c.fillRect(X(p[0]),T,Math.max(1,X(p[1])-X(p[0])),H-T-B);});
c.strokeStyle='#888';c.lineWidth=1;
D.steps.forEach(function(s){c.beginPath();c.moveTo(X(s),T);c.lineTo(X(s),H-B);c.stroke();});
var names=D.categories.filter(function(k){return first.stacks&&first.stacks[k];});
var base=first.x.map(function(){return 0;});
names.forEach(function(k){var v=first.stacks[k];c.fillStyle=C[k]||'#999';c.beginPath();
var i,n=first.x.length;c.moveTo(X(first.x[0]),Y(base[0]));
for(i=0;i<n;i++){var nx=i+1<n?first.x[i+1]:first.x[i];c.lineTo(X(first.x[i]),Y(base[i]+v[i]));
c.lineTo(X(nx),Y(base[i]+v[i]));}
for(i=n-1;i>=0;i--){var nx2=i+1<n?first.x[i+1]:first.x[i];c.lineTo(X(nx2),Y(base[i]));
c.lineTo(X(first.x[i]),Y(base[i]));}
c.closePath();c.fill();for(i=0;i<n;i++)base[i]+=v[i];});
D.timelines.forEach(function(t,j){c.strokeStyle=G[j%G.length];c.lineWidth=1.5;c.setLineDash([]);
c.beginPath();t.x.forEach(function(x,i){var y=Y(t.reserved[i]);if(i)c.lineTo(X(x),y);else
c.moveTo(X(x),y);});c.stroke();});
D.gpus.forEach(function(g,j){c.strokeStyle=G[j%G.length];c.lineWidth=1;
c.setLineDash([2,3]);c.beginPath();c.moveTo(L,Y(g.request));
c.lineTo(W-R,Y(g.request));c.stroke();c.fillStyle=G[j%G.length];
c.fillText(g.gpu+' request '+(g.request/1073741824).toFixed(2)+' GiB',W-R-260*(j+1),Y(g.request)-3);
var cap=g.gpu+' capacity '+(g.capacity/1073741824).toFixed(1)+' GiB';
if(g.capacity<=ymax){c.setLineDash([6,4]);c.beginPath();c.moveTo(L,Y(g.capacity));
c.lineTo(W-R,Y(g.capacity));c.stroke();c.fillText(cap,W-R-260*(j+1),Y(g.capacity)-3);}
else{c.fillText(cap+' (above)',L+10+260*j,T+12);}c.setLineDash([]);});
if(first.peak>=0){var px=X(first.x[first.peak]);c.fillStyle='#d62728';c.beginPath();
c.arc(px,Y(first.reserved[first.peak]),4,0,7);c.fill();}
c.fillStyle='#222';c.strokeStyle='#222';c.setLineDash([]);
c.beginPath();c.moveTo(L,T);c.lineTo(L,H-B);c.lineTo(W-R,H-B);c.stroke();
for(var k=0;k<=4;k++){var v=ymax*k/4;c.fillText((v/1073741824).toFixed(1)+' GiB',4,Y(v)+4);}
c.fillText('trace event',W/2,H-8);
var lg=document.getElementById('legend');
names.forEach(function(k){lg.insertAdjacentHTML('beforeend','<span><i style="background:'+
C[k]+'"></i>'+k+'</span>');});
D.gpus.forEach(function(g,j){lg.insertAdjacentHTML('beforeend','<span><i style="background:'+
G[j%G.length]+'"></i>'+g.gpu+' reserved</span>');});
cv.addEventListener('mousemove',function(ev){var r=cv.getBoundingClientRect();
var x=(ev.clientX-r.left-L)/(W-L-R)*xmax,best=-1,d=1e18;
first.x.forEach(function(v,i){var e=Math.abs(v-x);if(e<d){d=e;best=i;}});
if(best<0){tip.style.display='none';return;}
var tot=0;names.forEach(function(k){tot+=first.stacks[k][best];});
tip.textContent='event '+first.x[best]+': '+first.labels[best]+' | allocated '+
(tot/1073741824).toFixed(2)+' GiB, reserved '+(first.reserved[best]/1073741824).toFixed(2)+
' GiB';tip.style.left=(ev.clientX+12)+'px';tip.style.top=(ev.clientY+12)+'px';
tip.style.display='block';});
cv.addEventListener('mouseleave',function(){tip.style.display='none';});
document.body.setAttribute('data-drawn','yes');
})();
</script>
</body></html>
"""
