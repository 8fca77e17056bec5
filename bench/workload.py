"""Every benchmark's workloads: seeded lognormal lengths, prompts cut from real text as token ids,
and the three shapes (`base`, `shared_prefix`, `long_mix`) the offline and serving benchmarks run.

Owns the text, the length distributions, the shared system prompt and the tokenizer lookup; loads no
weights, knows nothing of engines or servers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from vllmlite.config import ceil_div
from vllmlite.models.model_source import RANDOM_MODEL, resolve_model
from vllmlite.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, read_gguf_fields

BASE, SHARED_PREFIX, LONG_MIX = "base", "shared_prefix", "long_mix"
WORKLOADS = (BASE, SHARED_PREFIX, LONG_MIX)
LONG_EVERY = 3  # in the long-prompt mix, every third request gets a long prompt

# Original prose written for this benchmark (free to use). Prompts are spans of its tokens, so the
# model reads real language rather than random ids.
CORPUS = """\
The harbour town of Elsmere was built on a spit of gravel that the sea had been trying to take back
for four hundred years. Every spring the tide gnawed a little more from the southern beach, and every
summer the town's carters hauled stone from the quarry on the hill to shore it up again. Nobody
remembered a year when the work had not been done, and nobody expected one. The children learned the
names of the breakwaters before they learned the names of the saints, and the oldest of them, a crooked
wall of black basalt called the Widow's Arm, was said to have been started by a woman whose husband
drowned within sight of his own door.

The lighthouse stood at the end of the spit, white and narrow, with a lantern room of green glass that
turned the beam the colour of seawater. Its keeper in those years was a patient man named Tobias Reed,
who kept a log of every ship that passed and every change in the weather. He wrote in a small, square
hand, and his entries were plain: the wind from the north-east, a brig under reduced sail, rain after
midnight, the lamp trimmed twice. Yet when his logbooks were opened a century later, historians found in
them a record of the town more faithful than any newspaper, because Reed had also written down what he
saw from his gallery in the afternoons: the fishing boats coming home, the market stalls going up and
coming down, the funerals winding up the hill road, the fires, the weddings and the slow growth of the
new harbour wall.

Trade came to Elsmere in waves, like everything else. For a generation the town lived on herring, and
the smokehouses along the quay burned day and night, so that travellers said they could smell the place
before they could see it. When the herring moved north the town turned to salt, boiling seawater in
great iron pans until the air was thick with steam. When salt from the inland mines undercut the pans,
the town turned to ships, and for fifty years its yards built schooners of oak and larch that carried
slate, coal and wool along the coast and sometimes as far as the Baltic. Each trade left something
behind: a street name, a recipe, a style of knot, a family that grew rich and built a house with too many
windows, a family that grew poor and moved away.

The schoolmaster, who was also the town's only surveyor, made a map of Elsmere every ten years. He
measured the beach with a chain and a compass, walked the lanes with a notebook, and drew the result on
heavy paper in brown and blue ink. Laid side by side, his maps show the town as a living thing. The
spit narrows and then widens again where the new walls hold. The quay grows a second arm. A row of
cottages appears on the western slope, then a chapel, then a school with a bell tower, then a railway
station that was only ever served by two trains a day. Streets bend to avoid a spring, a mill race, an
old boundary stone that nobody dared to move. The maps also show what was lost: a windmill that burned,
an orchard cut down for a ropewalk, a lane that slid into the sea one winter night with three houses
still standing on it.

What made the town endure was not any single trade or wall but a habit of attention. People noticed
small changes and talked about them. A crack in the quay was reported the morning it appeared. A boat
that came home late set the whole waterfront asking questions. The council met in the back room of the
inn and argued for hours about drains and moorings, and although the arguments were long, the decisions
were usually sound, because everyone who spoke had looked at the thing they were speaking about. When a
storm broke the Widow's Arm in the great gale of that century, the repair began before the wind had
dropped, with men and women passing stones hand to hand along the wall in the dark.

Visitors sometimes asked why anyone stayed. The winters were long, the work was hard, and the sea took
a life every few years no matter how careful people were. The answers they received were rarely the
same. Some people spoke of the light on the water in the evenings, when the whole bay turned copper and
the gulls went quiet. Some spoke of their families, who had been buried on the hill for ten generations.
Some simply said that they knew how the place worked, and that knowing how a place works is rarer and
more valuable than most people think. The keeper Tobias Reed, asked the same question by a travelling
journalist, is supposed to have answered that he stayed because somebody had to write it all down, and
that he had not yet found anyone else with the patience for it.
"""

SYSTEM_PROMPT = """\
You are a careful and friendly assistant working for the Elsmere Harbour Archive. You answer questions
about the town's history, its maritime trades, its lighthouse records and its maps. Follow these rules
in every reply. First, be accurate: if the archive does not say something, say that you do not know
rather than guessing, and never invent names, dates or numbers. Second, be clear: use short paragraphs,
explain any nautical or technical term the first time you use it, and prefer plain words to ornate ones.
Third, be helpful: when a question is ambiguous, answer the most likely reading and mention the other
briefly; when a visitor asks for directions to a place in the town, describe the route using landmarks
that still exist today. Fourth, be respectful: the archive holds records of shipwrecks and funerals, so
write about loss with care and without sensational detail. Fifth, stay on topic: politely decline
requests that have nothing to do with the town, its people or its records, and suggest where the
visitor might look instead. When you quote the keeper's logbooks, give the year and the page. When you
describe a map, say which decade it comes from and who drew it. Keep answers under three hundred words
unless the visitor asks for more detail, and end with a short suggestion of a related record or map the
visitor might enjoy reading next.
"""


@dataclass(frozen=True)
class LengthRange:
    """Lengths drawn from a lognormal whose median is the range's geometric midpoint and whose
    +-2 sigma spans the range, then clipped to it: (17, 251) -> median 65.3, sigma 0.673."""

    low: int
    high: int

    @property
    def median(self) -> float:
        return math.sqrt(self.low * self.high)

    @property
    def sigma(self) -> float:
        return math.log(self.high / self.low) / 4.0

    def draw(self, rng: np.random.Generator, count: int) -> list[int]:
        raw = rng.lognormal(math.log(self.median), self.sigma, size=count)  # [count]
        return np.clip(np.rint(raw), self.low, self.high).astype(int).tolist()


@dataclass(frozen=True)
class WorkloadSpec:
    num_requests: int
    prompt_lens: LengthRange
    output_lens: LengthRange
    system_prompt_len: int
    seed: int


@dataclass(frozen=True)
class BenchRequest:
    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int  # EOS is ignored, so every request produces exactly this many tokens

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


def tile_tokens(token_ids: list[int], length: int) -> list[int]:
    """Repeat `token_ids` until it is exactly `length` long: [1, 2, 3], 7 -> [1, 2, 3, 1, 2, 3, 1]."""
    repeats = -(-length // len(token_ids))
    return (token_ids * repeats)[:length]


def make_requests(tokenizer: Tokenizer, spec: WorkloadSpec) -> list[BenchRequest]:
    """`num_requests` prompts, each a span of the corpus starting at a distinct token (so no two
    prompts share a block-aligned prefix by accident), with seeded lognormal lengths."""
    rng = np.random.default_rng(spec.seed)
    prompt_lens = spec.prompt_lens.draw(rng, spec.num_requests)
    output_lens = spec.output_lens.draw(rng, spec.num_requests)
    corpus = tokenizer.encode(CORPUS, add_special_tokens=False)
    needed = spec.prompt_lens.high + spec.num_requests
    if len(corpus) < needed:  # a tiny tokenizer's corpus is long enough; this is a guard
        corpus = tile_tokens(corpus, needed)
    starts = rng.choice(len(corpus) - spec.prompt_lens.high, size=spec.num_requests, replace=False)
    return [BenchRequest(f"req-{i:03d}", corpus[s:s + n], m)
            for i, (s, n, m) in enumerate(zip(starts.tolist(), prompt_lens, output_lens))]


def system_prompt_tokens(tokenizer: Tokenizer, length: int) -> list[int]:
    """The shared system prompt, cut (or repeated) to exactly `length` tokens."""
    return tile_tokens(tokenizer.encode(SYSTEM_PROMPT, add_special_tokens=False), length)


def with_system_prompt(requests: list[BenchRequest], system: list[int]) -> list[BenchRequest]:
    """The same requests, each prompt prefixed by the shared system prompt."""
    return [BenchRequest(r.request_id, system + r.prompt_token_ids, r.max_tokens) for r in requests]


@dataclass(frozen=True)
class Lengths:
    """Length ranges of one benchmark size (full or --quick)."""

    prompts: LengthRange
    outputs: LengthRange
    long_prompts: LengthRange
    system_prompt_len: int


FULL = Lengths(LengthRange(17, 251), LengthRange(20, 192), LengthRange(512, 1536), 256)
QUICK = Lengths(LengthRange(8, 48), LengthRange(8, 24), LengthRange(64, 128), 32)


@dataclass(frozen=True)
class Workload:
    name: str
    requests: list[BenchRequest]
    max_model_len: int  # the longest request the ranges allow (prompt + output), in whole 16-token blocks

    @property
    def description(self) -> str:
        return {BASE: "the offline benchmark's lognormal set (bench/bench.py)",
                SHARED_PREFIX: "the same prompts behind one shared system prompt",
                LONG_MIX: f"the base set with every {LONG_EVERY}rd prompt replaced by a long one"}[self.name]


def load_tokenizer(model: str) -> tuple[Tokenizer, str]:
    """The tokenizer of `model` without its weights, and the resolved source (a GGUF path, a
    directory or "random")."""
    source = resolve_model(model)
    if source == RANDOM_MODEL:
        return ByteTokenizer(), source
    if Path(source).is_dir():
        return HFTokenizer.from_directory(source), source
    return HFTokenizer.from_gguf_fields(read_gguf_fields(source, prefix="")), source


def _round_to_blocks(num_tokens: int, block_size: int = 16) -> int:
    """Up to whole blocks: 251 + 192 -> 448."""
    return ceil_div(num_tokens, block_size) * block_size


def build_workload(name: str, tokenizer: Tokenizer, num_requests: int, lengths: Lengths, seed: int) -> Workload:
    """`base`: `num_requests` seeded lognormal requests (the same for every benchmark given the same
    seed and lengths); `shared_prefix`: those behind one system prompt; `long_mix`: every third prompt long."""
    spec = WorkloadSpec(num_requests, lengths.prompts, lengths.outputs, lengths.system_prompt_len, seed)
    base = make_requests(tokenizer, spec)
    longest_prompt = lengths.prompts.high
    if name == SHARED_PREFIX:
        base = with_system_prompt(base, system_prompt_tokens(tokenizer, lengths.system_prompt_len))
        longest_prompt += lengths.system_prompt_len
    elif name == LONG_MIX:
        longs = make_requests(tokenizer, WorkloadSpec(num_requests, lengths.long_prompts, lengths.outputs, 0, seed + 1))
        base = [BenchRequest(r.request_id, (longs[i] if i % LONG_EVERY == LONG_EVERY - 1 else r).prompt_token_ids,
                             r.max_tokens) for i, r in enumerate(base)]
        longest_prompt = lengths.long_prompts.high
    elif name != BASE:
        raise ValueError(f"unknown workload {name!r}; choose from {WORKLOADS}")
    return Workload(name, base, _round_to_blocks(longest_prompt + lengths.outputs.high))
