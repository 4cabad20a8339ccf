"""Write the embedded default corpus (Shakespeare's plays, one scene per line) as JSONL.

python tools/prepare_default_corpus.py --output data/shakespeare.jsonl
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from threefold.arguments import ToolParser  # noqa: E402
from threefold.config import ConfigError  # noqa: E402
from threefold.data.corpus import default_corpus_documents, write_jsonl  # noqa: E402
from threefold.output_directory import make_parent_directory  # noqa: E402


def main() -> None:
    parser = ToolParser(prog="prepare_default_corpus.py", description=__doc__)
    parser.add_argument("--output", required=True, help="the JSONL file to write")
    args = parser.parse_args()
    try:
        make_parent_directory(args.output, "--output", a_file=True)
    except ConfigError as error:
        parser.error(str(error))
    count = write_jsonl(default_corpus_documents(), args.output)
    print(
        f"wrote {count} documents to {args.output} ({os.path.getsize(args.output) / 2**20:.1f} MiB)"
    )


if __name__ == "__main__":
    main()
