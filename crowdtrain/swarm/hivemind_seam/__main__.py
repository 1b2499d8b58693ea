"""``python -m crowdtrain.swarm.hivemind_seam``: every seam's upstream digest in the installed
hivemind, and which differ from the recorded ones (run after bumping the pin)."""

from crowdtrain.swarm.hivemind_seam import SEAMS, changed_upstream, upstream_digest

if __name__ == "__main__":
    changed = {seam.ours for seam, _ in changed_upstream()}
    for seam in SEAMS:
        mark = "CHANGED" if seam.ours in changed else "same"
        print(f"{mark:8} {upstream_digest(seam.upstream) if seam.ours not in changed else '?':16}  {seam.upstream}")
