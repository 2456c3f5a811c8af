"""python -m jaxtp.data prepare --tokenizer PATH --out FILE TEXT_FILE...

Tokenize UTF-8 text with a Hugging Face tokenizer (tokenizer.json, or a
checkpoint directory holding one) into a token file for `train.py --data`.
Needs the tokenizers package: pip install -e ".[data]". Exit status: 0
written, 2 a usage or input error, 130 stopped by Ctrl-C (nothing written).
"""

from __future__ import annotations

import argparse
import sys

from ..cli import Parser
from . import prepare


def main(argv=None) -> int:
    ap = Parser(prog="python -m jaxtp.data", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="tokenize text files into a token file")
    p.add_argument("--tokenizer", required=True, metavar="PATH",
                   help="tokenizer.json, or a directory holding one")
    p.add_argument("--out", required=True, metavar="FILE", help="the token file to write")
    p.add_argument("--eos", metavar="TOKEN",
                   help="the end-of-text token between documents (default: the first of "
                        "<|end_of_text|>, <|endoftext|>, </s>, <eos>, <|eot_id|> it knows)")
    p.add_argument("texts", nargs="+", metavar="TEXT_FILE", help="UTF-8 text, one document each")
    args = ap.parse_args(argv)
    try:
        prepare(args.tokenizer, args.out, args.texts, eos=args.eos)
    except (ValueError, OSError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"stopped by Ctrl-C: {args.out} was not written", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
