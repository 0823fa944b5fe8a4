"""What the single-device training examples share: a progress bar, the step timer, the closing
table and the note printed on the CPU. No dependency beyond torch: tqdm is used when it is
installed, else a plain text bar (the examples must not add a runtime dependency)."""
import contextlib
import sys
import time

import torch

CPU_NOTE = ("CPU run: jagflash executes its float64 C++ reference (a correctness path, single-threaded), "
            "so the sizes are tiny and tokens/s says nothing about the GPU kernels. Use a CUDA device "
            "for speed figures.")


class _TextBar:
    """A one-line bar on stderr, redrawn in place: `name [#####.....] 5/10 loss 1.23`."""

    def __init__(self, total, desc, width=30, stream=None):
        self.total, self.desc, self.width, self.done = total, desc, width, 0
        self.stream = stream if stream is not None else sys.stderr
        self.drawn = 0  # the last line's length: a shorter one is padded to wipe it out

    def _draw(self, postfix, end=""):
        filled = self.width * self.done // max(self.total, 1)
        line = f"{self.desc} [{'#' * filled}{'.' * (self.width - filled)}] {self.done}/{self.total} {postfix}"
        self.stream.write("\r" + line.ljust(self.drawn) + end)
        self.stream.flush()
        self.drawn = len(line)

    def step(self, postfix=""):
        self.done += 1
        self._draw(postfix)

    def close(self, postfix=""):
        self._draw(postfix, end="\n")


class _TqdmBar:
    def __init__(self, tqdm, total, desc):
        self.bar = tqdm(total=total, desc=desc, leave=True)

    def step(self, postfix=""):
        self.bar.set_postfix_str(postfix, refresh=False)
        self.bar.update(1)

    def close(self, postfix=""):
        self.bar.set_postfix_str(postfix)
        self.bar.close()


class _NoBar:
    def step(self, postfix=""):
        pass

    def close(self, postfix=""):
        pass


def progress_bar(total, desc, mode="auto"):
    """A bar with .step(postfix) once per step and .close(postfix) at the end. mode: "auto"
    (tqdm when installed, else the text bar), "tqdm", "text" or "none"."""
    if mode == "none":
        return _NoBar()
    if mode in ("auto", "tqdm"):
        try:
            from tqdm.auto import tqdm
        except ImportError:
            if mode == "tqdm":
                raise
        else:
            return _TqdmBar(tqdm, total, desc)
    return _TextBar(total, desc)


def add_progress_argument(parser):
    parser.add_argument("--progress", choices=("auto", "tqdm", "text", "none"), default="auto",
                        help="progress bar: tqdm when installed (auto), a built-in text bar, or none")


class StepTimer:
    """Tokens/s over the steps after the warm-up ones (the first steps pay for allocator growth,
    kernel selection and lazy initialisation, which a long run amortises). On CUDA the clock is
    read after a synchronize, so the figure covers the GPU's work, not only its launch."""

    def __init__(self, device, warmup_steps):
        self.device, self.warmup_steps = device, warmup_steps
        self.tokens, self.start, self.steps = 0, None, 0

    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def before_step(self, step):
        if step == self.warmup_steps:
            self._sync()
            self.start = time.perf_counter()

    def after_step(self, step, tokens):
        if step >= self.warmup_steps:
            self.tokens += tokens
            self.steps += 1

    def tokens_per_s(self):
        if self.start is None or self.steps == 0:
            return float("nan")  # every step was a warm-up one
        self._sync()
        return self.tokens / (time.perf_counter() - self.start)


def default_warmup(steps, device):
    """Two warm-up steps on CUDA, one on the CPU (short runs), always leaving one step timed."""
    return max(0, min(2 if device.type == "cuda" else 1, steps - 1))


def print_table(rows, skipped):
    """rows: (implementation, tokens/s, final loss); skipped: {implementation: why}."""
    header = ("implementation", "tokens/s", "final loss")
    cells = [(name, f"{rate:,.0f}", f"{loss:.4f}") for name, rate, loss in rows]
    cells += [(name, "skipped", "-") for name in skipped]
    widths = [max(len(r[i]) for r in [header, *cells]) for i in range(3)]
    line = "  ".join("{:<%d}" % w if i == 0 else "{:>%d}" % w for i, w in enumerate(widths))
    print(line.format(*header))
    print(line.format(*("-" * w for w in widths)))
    for row in cells:
        print(line.format(*row))
    for name, why in skipped.items():
        print(f"{name} skipped: {why}")


@contextlib.contextmanager
def cpu_threads(device):
    """One torch thread while training on the CPU, the setting restored after. jagflash's CPU
    reference runs on one thread, so this compares like with like; and at the CPU sizes torch's
    OpenMP threads cost more in synchronisation than they save (on a busy 2-core machine a step
    took ten times longer with two)."""
    if device.type != "cpu":
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def add_common_arguments(parser, implementations):
    """The arguments both training examples take besides their model's: device, steps, warm-up,
    seed, which implementations to run, the progress bar."""
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per implementation")
    parser.add_argument("--lr", type=float, default=None)
    parser.add_argument("--warmup", type=int, default=None, help="untimed first steps (default: 2 CUDA, 1 CPU)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--implementations", nargs="+", choices=implementations, default=list(implementations))
    add_progress_argument(parser)


def finish_args(parser, argv, gpu_defaults, cpu_defaults):
    """Parses argv, then fills every argument left unset from the defaults of the device it will
    run on (the GPU sizes would take hours on the CPU) and the warm-up from the step count."""
    args = parser.parse_args(argv)
    args.device = device_of(args.device)
    for name, value in (gpu_defaults if args.device.type == "cuda" else cpu_defaults).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.warmup is None:
        args.warmup = default_warmup(args.steps, args.device)
    return args


def device_of(name):
    """--device's value, None meaning CUDA when there is one."""
    if name is None:
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)
