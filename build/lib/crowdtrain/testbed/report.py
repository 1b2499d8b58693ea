"""Tables of a testbed run or of the whole suite, as plain text (printed and saved)."""

from __future__ import annotations


def _f(x, fmt: str = ".2f", none: str = "-") -> str:
    return none if x is None else format(x, fmt)


def run_table(s: dict) -> str:
    """One run: its gradient rounds against the floor, utilization and throughput."""
    r = s["rounds"]
    lines = [f"run {s['name']}: {s['peers']} peers on {', '.join(s['links'])}, {r['params'] / 1e6:.1f}M parameters "
             f"({r['gradient_wire_bytes'] / 1e6:.1f} MB per compressed gradient copy), target batch "
             f"{s['target_batch_size']}, delayed updates {'on' if s['delayed_updates'] else 'off'}",
             f"  gradient rounds      {r['full_rounds']} with every peer, of {r['all_rounds']}",
             f"  round time           {_f(r.get('round_s_median'))} s median vs floor {_f(r.get('floor_s'))} s: "
             f"{_f(r.get('ratio_median'))}x (best {_f(r.get('ratio_best'))}x)",
             f"  bytes up per round   {_f(r.get('upload_volume_ratio'), '.3f')}x the butterfly volume 2(N-1)/N x model",
             f"  compute utilization  {_f(s['utilization_mean'])} (mean over peers, between first and last epoch)",
             f"  swarm throughput     {_f(s['swarm_samples_per_s'])} samples/s",
             f"  steps over budget    {s['over_budget_steps']} of {s['steps']} (real compute above --simulated-step-s)"]
    for name, p in sorted(s["per_peer"].items()):
        lines.append(f"    {name:<4} utilization {_f(p.get('utilization'))}  waiting {_f(p.get('wait_share'))}  "
                     f"{_f(p.get('samples_per_s'), '.3f')} samples/s over {_f(p.get('span_s'), '.0f')} s")
    return "\n".join(lines)


def suite_tables(results: dict) -> str:
    out = []
    out.append("Averaging round time vs bandwidth floor (gradient all-reduce, median over rounds with every peer)")
    out.append(f"{'N':>3} {'link':>8} {'rounds':>7} {'measured s':>11} {'floor s':>8} {'ratio':>6} {'best':>6} "
               f"{'bytes/expected':>15}")
    for rate in ("100", "10"):
        for n in (2, 4, 8):
            res = results.get(f"r{rate}-n{n}")
            if not res or "rounds" not in res:
                out.append(f"{n:>3} {rate + 'mbit':>8}  {'(not run)' if not res else res.get('error', '')[:60]}")
                continue
            r = res["rounds"]
            out.append(f"{n:>3} {rate + 'mbit':>8} {r['full_rounds']:>7} {_f(r.get('round_s_median')):>11} "
                       f"{_f(r.get('floor_s')):>8} {_f(r.get('ratio_median')):>6} {_f(r.get('ratio_best')):>6} "
                       f"{_f(r.get('upload_volume_ratio'), '.3f'):>15}")
    control = results.get("r1000-n4", {}).get("rounds", {})
    if control.get("full_rounds"):
        out.append(f"  4   1gbit {control['full_rounds']:>7} {_f(control.get('round_s_median')):>11} "
                   f"{_f(control.get('floor_s')):>8} {_f(control.get('ratio_median')):>6} "
                   f"{_f(control.get('ratio_best')):>6} {_f(control.get('upload_volume_ratio'), '.3f'):>15}"
                   "   (control: the CPU's share of a round)")
    out.append("")
    out.append("Compute utilization, N = 4 (share of wall time computing gradients; mean over peers)")
    out.append(f"{'link':>8} {'delayed updates':>16} {'no delay':>9} {'epoch s (delayed)':>18}")
    for rate in ("100", "10"):
        a, b = results.get(f"r{rate}-n4", {}), results.get(f"r{rate}-n4-nodelay", {})
        epoch = None
        spans = [p for p in a.get("per_peer", {}).values() if p.get("epochs")]
        if spans:
            epoch = sum(p["span_s"] / p["epochs"] for p in spans) / len(spans)
        out.append(f"{rate + 'mbit':>8} {_f(a.get('utilization_mean')):>16} {_f(b.get('utilization_mean')):>9} "
                   f"{_f(epoch, '.1f'):>18}")
    hetero = results.get("hetero")
    if hetero and "per_peer" in hetero:
        out.append("")
        out.append("Heterogeneity: p1, p2 100mbit at 3 s/step; p3 10mbit up/50mbit down; "
                   "p4 a device 3x slower (9 s/step)")
        out.append(f"{'peer':>6} {'solo samples/s':>15} {'in swarm':>9} {'utilization':>12}")
        for name, p in sorted(hetero["per_peer"].items()):
            solo = hetero.get("solo_samples_per_s", {}).get(name)
            out.append(f"{name:>6} {_f(solo, '.3f'):>15} {_f(p.get('samples_per_s'), '.3f'):>9} "
                       f"{_f(p.get('utilization')):>12}")
        out.append(f"swarm / sum of solos = {_f(hetero.get('ratio_to_solo_sum'))} "
                   f"(target batch {hetero['target_batch_size']})")
    dilocos = [(name, r) for name, r in sorted(results.items()) if "diloco" in r and "per_peer" in r]
    if dilocos:
        out.append("")
        out.append("DiLoCo mode, 4 peers (compute utilization; pseudo-gradient rounds, trigger to outer step;")
        out.append("waiting: share of time in the optimizer's step, inner AdamW steps included; overlap: "
                   "overlap_outer_round)")
        out.append(f"{'run':>24} {'link':>7} {'overlap':>8} {'utilization':>12} {'waiting':>8} {'epoch s':>8} "
                   f"{'round s':>8} {'floor s':>8} {'rounds':>7}")
        for name, r in dilocos:
            d = r.get("diloco", {})
            spans = [p for p in r["per_peer"].values() if p.get("epochs")]
            epoch = sum(p["span_s"] / p["epochs"] for p in spans) / len(spans) if spans else None
            waiting = sum(p["wait_share"] for p in spans) / len(spans) if spans else None
            out.append(f"{name:>24} {','.join(r['links']):>7} {'on' if d.get('overlap') else 'off':>8} "
                       f"{_f(r.get('utilization_mean')):>12} {_f(waiting):>8} {_f(epoch, '.1f'):>8} "
                       f"{_f(d.get('round_s_median'), '.1f'):>8} {_f(d.get('floor_s'), '.1f'):>8} "
                       f"{d.get('full_records', 0):>7}")
    churn = (results.get("churn") or {}).get("churn")
    if churn:
        out.append("")
        out.append(f"Churn on {', '.join(results['churn']['links'])} links: {churn['killed']} killed (SIGKILL), "
                   f"{churn['newcomer']} joins later")
        for label, w in churn["windows"].items():
            lost = ", ".join(f"{n} {v:.1f}" for n, v in sorted(w["lost_s_per_peer"].items()))
            out.append(f"  {label:<11} {w['seconds']:.0f} s window: seconds of work lost per survivor "
                       f"(vs its rate before) {lost or '-'}; mean {_f(w['lost_s_mean'], '.1f')}")
        first_round = _f(churn["first_full_round_after_kill_s"], ".1f")
        out.append(f"  first round with every live peer after the kill: {first_round} s"
                   f" later; newcomer loaded state in {_f(churn.get('newcomer_state_load_s'), '.1f')} s, first "
                   f"epoch {_f(churn.get('newcomer_first_epoch_s'), '.1f')} s after it started")
    return "\n".join(out)
