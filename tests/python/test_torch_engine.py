# SPDX-License-Identifier: MIT
"""eval/kvd-lm/kvd-lm-torch.py, kvd-lm's inference in PyTorch with its cache in kvd, against
the C engine (kvd-lm) and its own private-cache run, on the trained model:

- without eviction, its logits equal the C engine's on kvd and its own with a private full
  cache, within the tolerance of tests/kvd-lm/test-kvd-lm-logits.c (1e-4 of the logits'
  scale: fp32 summed in other orders);
- with evictions at fixed points (--evict-every: both engines ask for the same rounds after
  the same steps, under the position-only policy streamingllm, so that both caches hold the
  same tokens), its logits equal the C engine's within the same tolerance, and differ from
  the unevicted run's;
- with the moments of the evicted tokens added to attention (--compensation moments-mass,
  then moments-bounded), the same, and the moments change the logits;
- every attention of its runs is checked against a dense one over the same tokens read
  another way (--check: Seq.block and Seq.position, not the block tables);
- decoding speculatively (--draft: draft tokens fed with each step, the rejected ones
  truncated from the sequence), its tokens and logits are plain decoding's;
- 4 samples forked from the prompt's sequence give bit for bit the samples run on
  sequences of their own, holding less than half the memory; a second request of a shared
  system prompt, opened with its prompt's keys, prefills only what was not found and gives
  the logits of the unshared run.

Environment (meson): KVD_DAEMON, KVD_LM (the C engine), KVD_LM_TORCH (the script),
KVD_LM_MODELS (eval/kvd-lm/models).
"""

import os
import subprocess
import sys
import unittest

from kvdtest import CUDA, Daemon  # first: it skips the test without numpy or torch

import torch  # noqa: E402

import kvd  # noqa: E402

MODEL = os.path.join(os.environ.get("KVD_LM_MODELS", ""), "kvd-lm-small.kvdlm")
HAYSTACK = os.path.join(os.path.dirname(os.environ.get("KVD_LM_TORCH", "")), "data",
                        "haystack.txt")
TOL = 1e-4


def logits_of(out):
    """{position: (token, logits tensor)} of --print-logits lines."""
    rows = {}
    for line in out.splitlines():
        if line.startswith("logits "):
            f = line.split()
            rows[int(f[1])] = (int(f[2]), torch.tensor([float(x) for x in f[3:]]))
    return rows


@unittest.skipIf(CUDA, "the engine touches K/V with the CPU")
class TorchEngineTest(unittest.TestCase):
    def setUp(self):
        with open(HAYSTACK) as f:
            self.prompt = f.read(400).replace("\n", " ") + " The key is"

    def run_engine(self, argv, policy=None):
        """Runs an engine against a daemon of its own (its tenant's policy set first):
        returns (stdout, the tokens the daemon evicted from it)."""
        daemon = Daemon("--chunk-size", "256KiB")
        try:
            if policy:
                with kvd.Client(daemon.socket) as admin:
                    admin.tenant_set("kvd-lm", policy=policy)
            out = subprocess.run(argv + ["--socket", daemon.socket], capture_output=True,
                                 text=True, timeout=300)
            self.assertEqual(out.returncode, 0, out.stderr)
            with kvd.Client(daemon.socket) as admin:
                tenant = admin.status().tenant("kvd-lm", "evicted_tokens") \
                    if "kvd-lm" in admin.status().tenants() else 0
            return out.stdout, tenant
        finally:
            self.assertEqual(daemon.stop(), 0)

    def engines(self, extra, policy=None):
        common = ["--model", MODEL, "--prompt", self.prompt, "--max-new", "12",
                  "--print-logits", "--unit", "layer", "--chunk", "128"] + extra
        c_out, c_evicted = self.run_engine([os.environ["KVD_LM"], "--threads", "1"] + common,
                                           policy)
        t_out, t_evicted = self.run_engine([sys.executable, os.environ["KVD_LM_TORCH"],
                                            "--check"] + common, policy)
        return logits_of(c_out), c_evicted, logits_of(t_out), t_evicted

    def assert_same_logits(self, got, want):
        self.assertEqual(sorted(got), sorted(want))
        for pos, (token, ref) in want.items():
            self.assertEqual(got[pos][0], token, f"position {pos}")
            scale = max(1.0, float(ref.abs().max()))
            self.assertLessEqual(float((got[pos][1] - ref).abs().max()), TOL * scale,
                                 f"position {pos}")

    def test_without_eviction(self):
        c, c_evicted, t, t_evicted = self.engines([])
        self.assertEqual((c_evicted, t_evicted), (0, 0))
        self.assertEqual(len(t), 12)
        self.assert_same_logits(t, c)
        private = subprocess.run([sys.executable, os.environ["KVD_LM_TORCH"], "--model", MODEL,
                                  "--prompt", self.prompt, "--max-new", "12", "--print-logits",
                                  "--no-daemon", "--chunk", "128"],
                                 capture_output=True, text=True, timeout=300)
        self.assertEqual(private.returncode, 0, private.stderr)
        self.assert_same_logits(t, logits_of(private.stdout))

    def test_with_evictions_at_fixed_points(self):
        c, c_evicted, t, t_evicted = self.engines(
            ["--evict-every", "4", "--evict-bytes", str(256 << 10)], policy="streamingllm")
        self.assertGreater(c_evicted, 0)
        self.assertEqual(t_evicted, c_evicted)
        self.assert_same_logits(t, c)
        # The evictions changed what the model saw.
        full, _ = self.run_engine([sys.executable, os.environ["KVD_LM_TORCH"], "--model", MODEL,
                                   "--prompt", self.prompt, "--max-new", "12", "--print-logits",
                                   "--unit", "layer", "--chunk", "128"])
        full = logits_of(full)
        self.assertTrue(any(float((t[p][1] - full[p][1]).abs().max()) > 1e-2 for p in t
                            if p in full))

    def test_speculative_drafts_truncated(self):
        argv = [sys.executable, os.environ["KVD_LM_TORCH"], "--model", MODEL, "--prompt",
                self.prompt, "--max-new", "24", "--no-stop", "--print-logits", "--unit",
                "layer", "--chunk", "128", "--check"]
        plain, _ = self.run_engine(argv)
        daemon = Daemon("--chunk-size", "256KiB")
        try:
            out = subprocess.run(argv + ["--draft", "4", "--stats", "--socket", daemon.socket],
                                 capture_output=True, text=True, timeout=300)
            self.assertEqual(out.returncode, 0, out.stderr)
            with kvd.Client(daemon.socket) as admin:
                truncates = admin.status().get("truncates")
        finally:
            self.assertEqual(daemon.stop(), 0)
        self.assertGreater(truncates, 0)
        self.assertIn("draft tokens accepted", out.stderr)
        self.assertEqual(out.stdout.splitlines()[-1], plain.splitlines()[-1])
        spec = logits_of(out.stdout)
        self.assertEqual(len(spec), 24)
        self.assert_same_logits(spec, logits_of(plain))

    def shared_run(self, extra):
        """The engine with its samples or requests (extra) sharing, then not: (logits of
        each, keyed by label and position; what --stats said)."""
        runs = []
        for share in ([], ["--no-share"]):
            daemon = Daemon("--chunk-size", "256KiB")
            try:
                out = subprocess.run([sys.executable, os.environ["KVD_LM_TORCH"], "--model", MODEL,
                                      "--prompt", self.prompt, "--max-new", "8", "--no-stop",
                                      "--print-logits", "--unit", "layer", "--chunk", "128",
                                      "--check", "--stats", "--socket", daemon.socket] + extra +
                                     share, capture_output=True, text=True, timeout=300)
                self.assertEqual(out.returncode, 0, out.stderr)
            finally:
                self.assertEqual(daemon.stop(), 0)
            rows = {}
            for line in out.stdout.splitlines():
                f = line.split()
                if len(f) > 2 and f[2] == "logits":
                    rows[(f[0], int(f[1]), int(f[3]))] = (int(f[4]), line)
            stats = [int(w) for w in out.stderr.split("kvd-lm-torch: ")[-1].split()
                     if w.isdigit()]
            runs.append((rows, stats))
        return runs

    def test_fork_samples(self):
        # 4 samples of the prompt, forked: bit for bit the samples on their own sequences,
        # in about a quarter of the memory.
        (forked, fs), (alone, as_) = self.shared_run(["--samples", "4"])
        self.assertEqual(len(forked), 4 * 8)
        self.assertEqual(forked, alone)
        self.assertLess(fs[0] * 2, as_[0])           # block bytes held
        self.assertEqual(fs[2], 3 * (fs[3] // 4))    # 3 prompts' tokens not prefilled
        self.assertEqual(as_[2], 0)

    def test_prefix_requests(self):
        # Two requests with the prompt as their system prompt: the second finds its full
        # blocks, and its logits are the unshared run's (within TOL: skipping the prefix
        # moves the prefill's chunk boundaries, and torch's sums follow the chunk's size).
        (shared, ss), (plain, ps) = self.shared_run(["--question", " What is the key?",
                                                     "--question", " Where is it kept?"])
        self.assertEqual(sorted(shared), sorted(plain))
        for key, (token, line) in plain.items():
            self.assertEqual(shared[key][0], token, key)
            got = torch.tensor([float(x) for x in shared[key][1].split()[5:]])
            want = torch.tensor([float(x) for x in line.split()[5:]])
            self.assertLessEqual(float((got - want).abs().max()),
                                 TOL * max(1.0, float(want.abs().max())), key)
        self.assertGreater(ss[2], 0)                 # prompt tokens not prefilled
        self.assertEqual(ps[2], 0)
        self.assertLess(ss[0], ps[0])

    def test_moments_compensation(self):
        evict = ["--evict-every", "4", "--evict-bytes", str(256 << 10)]
        plain, _ = self.run_engine([sys.executable, os.environ["KVD_LM_TORCH"], "--model", MODEL,
                                    "--prompt", self.prompt, "--max-new", "12", "--print-logits",
                                    "--unit", "layer", "--chunk", "128"] + evict, "streamingllm")
        plain = logits_of(plain)
        for form in ("moments-mass", "moments-bounded"):
            with self.subTest(form=form):
                c, c_evicted, t, t_evicted = self.engines(evict + ["--compensation", form],
                                                          policy="streamingllm")
                self.assertGreater(c_evicted, 0)
                self.assertEqual(t_evicted, c_evicted)
                self.assert_same_logits(t, c)
                # The moments' entry changed the logits of the same cache.
                self.assertTrue(any(float((t[p][1] - plain[p][1]).abs().max()) > 1e-3 for p in t
                                    if p in plain))


if __name__ == "__main__":
    unittest.main(verbosity=2)
