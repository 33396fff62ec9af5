"""The built-in tiny model's vocabulary: every token text in id order, built in code.

Pure data and one pure function; no files, no downloads, no imports beyond the standard library.
"""

from __future__ import annotations

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHARS = "\n\t" + "".join(chr(c) for c in range(0x20, 0x7F))  # newline, tab, printable ASCII
MIN_VOCAB_SIZE = len(SPECIALS) + len(CHARS)  # 100: the specials and the characters
REPLACEMENT = "?"  # what each character outside CHARS encodes to
WHITESPACE_TOKENS = (" ", "\t", "\n", "    ")  # the only ids that decode to no visible char

# The tiny model's vocabulary after the specials and the characters, in id order: words with
# a leading space (" the"), pieces as written (word starts, common trigrams, code), syllables.
_WORDS = """
the of and to in is it that for you on with as are be this was have or by not from at but a an they
which one all we can will there has more if their your what about so when out up he use do no its
would other some into than them only new also make time like how any these then first get may way
each now just see need want know should could must here where why my file files code test tests run
line lines error errors value values type name data list set call function method return class
import model token tokens request server read write open close path build step steps tool turn turns
agent cache user system assistant message input output result number string key text check fix pass
passed fail failed bug change add remove update create delete find search look show start stop next
last end done help please thanks sure let me think answer question problem issue case example note
version repository repo README main branch commit module package install config option default print
log debug info warning status source include local remote size length count index array object field
self none true false null int str float bool dict map loop block blocks layer batch queue load save
copy move keep same old good well she his her him our us were been had did does said got go going
made take used using work works very much many most such even still through over after before
because while between both under again few own those two three off down back right left wrong
session prefix
"""
_PIECES = """
The I It This In If We You A For To What How When There Here Yes No OK Let Please Thanks system user
assistant ing ed er es ly tion ment ness able ers est ful ive ous ity ize al ent ance ence ant ary
th he an in on at en nd re or te st nt ng se ha as ou io le ve co me de hi ri ro ic ne ea ra ce li
ch ll be ma si om ur ion tio ati her ter hat tha ere ate his con res ver all ons nce men ith ted pro
thi wit are ess not was ect rea com eve per int sta cti ica ist ear ain one our iti rat qu ow ay ck
ss ff mp ct ns ts ry def return import from class print else elif try except raise with pass break
continue yield lambda async await None True False self const let var function null undefined true
false len range args kwargs json http https assert __init__ __name__ __main__ () (): ): (self self.
== != <= >= -> => += -= ** // :// .py .md .json ... --- ``` `` [] {} [0] [i] __ '' "" 's n't 're 've
'll 00 10 1. 2. 3. 0x
"""
_CODE = (
    "def ",
    "if ",
    "for ",
    "in ",
    "not ",
    "and ",
    "or ",
    "is ",
    "import ",
    "from ",
    "class ",
    "return ",
    "print(",
    "len(",
    "range(",
    "self.",
    "# ",
    "- ",
    "* ",
    "$ ",
    ">>> ",
    "    ",
    ", ",
    ". ",
    ": ",
    "; ",
    ".\n",
    ":\n",
    ",\n",
    "?\n",
    "!\n",
    "{\n",
    "}\n",
    "]\n",
    ")\n",
    " (",
    ' "',
    " '",
    " =",
    " +",
    " -",
    " *",
    " /",
    " #",
    " {",
    " [",
    " <",
    " >",
    " 0",
    " 1",
    " 2",
    '="',
    '":',
    '",',
    '")',
    "')",
    "])",
    "})",
    ");",
    "};",
    "\n#",
    "\n-",
    "\n*",
    "\n>",
    " |",
    "| ",
    " `",
    "` ",
    "--",
    "s\n",
    "e\n",
)
_ONSETS = "b c d f g h j k l m n p r s t v w y z bl br ch cl cr dr fl fr gr pl pr sh sp st th tr"
_VOWELS = "a e i o u ai ea ee oo ou"
_CODAS = "b ck d g l ll m n nd ng nt p r rt s ss st t x"


def _syllables() -> list[str]:
    """Word starts (" " + onset + vowel), rimes (vowel + coda), onset + vowel, then the same
    with a coda: the filler after the listed pieces, most useful first."""
    onsets, vowels, codas = _ONSETS.split(), _VOWELS.split(), _CODAS.split()
    open_ = [c + v for c in onsets for v in vowels]
    rimes = [v + k for v in vowels for k in codas]
    closed = [c + v + k for c in onsets for v in vowels for k in codas]
    return [" " + o for o in open_] + rimes + open_ + [" " + c for c in closed] + closed


def tiny_vocabulary() -> tuple[str, ...]:
    """Every token text of the largest ``TinyTokenizer``, in id order: specials, characters,
    then the multi-character pieces (duplicates dropped, first place kept)."""
    pieces = [" " + w for w in _WORDS.split()] + _PIECES.split() + [*_CODE, *_syllables()]
    multi = dict.fromkeys(p for p in pieces if len(p) > 1)  # insertion-ordered: deterministic
    return (*SPECIALS, *CHARS, *multi)
