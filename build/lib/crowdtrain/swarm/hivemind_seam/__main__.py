"""``python -m crowdtrain.swarm.hivemind_seam``: every seam's upstream digest in the installed
hivemind, marking those that differ from the recorded ones (run after bumping the pin)."""

from crowdtrain.swarm.hivemind_seam import SEAMS, changed_upstream

if __name__ == "__main__":
    changed = {seam.ours: digest for seam, digest in changed_upstream()}
    for seam in SEAMS:
        digest = changed.get(seam.ours, seam.digest)
        print(f"{'CHANGED' if seam.ours in changed else 'same':8} {digest:16}  {seam.upstream}  ({seam.canary})")
