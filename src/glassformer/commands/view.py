"""`glassformer view`: the explorer, a local web page that shows the model's computation."""

from __future__ import annotations

from ..errors import UserError
from .access import add_access_arguments, allowed_hosts, api_key
from .options import add_base_argument, add_device_argument, add_quantize_argument

HELP = "the explorer: a local page that traces a sentence and shows every number of its computation"

DEFAULT_TEXT = "the cat sat on the mat"


def add_arguments(p) -> None:
    src = p.add_mutually_exclusive_group()  # one of them, or --run (with or without --checkpoint)
    src.add_argument("--checkpoint", metavar="CKPT", help="checkpoint, training run or Hugging Face folder, or a Hub name org/name[@revision]")
    src.add_argument("--worked", action="store_true", help="the walkthrough's one-head toy model ('I like cats too')")
    p.add_argument("--run", metavar="RUN", default=None,
                   help="a training run folder (train --out): adds the Training view, its curves and a checkpoint "
                        "slider over the run's checkpoints; the model is --checkpoint's, else the run's latest")
    p.add_argument("--variant", default="one_head",
                   help="with --worked: one_head, two_blocks_pre, two_blocks_post, mha, gqa or mqa")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on; anything but loopback needs an API key (or --insecure-no-key)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (0: any free port)")
    p.add_argument("--text", default=None, help="the sentence the page opens with")
    p.add_argument("--sae", metavar="SAE", default=None,
                   help="a sparse autoencoder of this model (`glassformer sae train`): its feature browser at /features "
                        "(docs/research.md#sparse-autoencoders)")
    p.add_argument("--sae-data", metavar="DATA", default=None,
                   help="with --sae: the text file or prepared folder whose top-activating contexts the browser shows")
    add_access_arguments(p)
    add_device_argument(p)
    add_quantize_argument(p, "explore")
    add_base_argument(p)


def build_explorer(args):
    from ..viewer import source
    from .options import apply_quantize, quantize_method

    quantize_method(args)  # before the weights are read
    if not (args.checkpoint or args.worked or args.run):
        raise UserError("give --checkpoint CKPT, --run RUN or --worked: the model the explorer shows")
    if args.sae is not None and (args.worked or args.run):
        raise UserError("--sae goes with --checkpoint: the model the SAE was trained on")
    if args.worked and args.run:
        raise UserError("--run shows a training run's checkpoints; --worked is the walkthrough's toy model: give one")
    if args.worked:
        ex = source.worked_explorer(args.variant)
        if args.text:
            ex.default_text = args.text
        return ex
    from ..checkpoint.loading import load
    from ..devices import resolve_device

    device = resolve_device(args.device)  # before any weights are read

    def open_model(path):
        model, tokenizer = load(path, base=args.base)
        return apply_quantize(model, args).to(device).eval(), tokenizer

    if args.run:
        return source.run_explorer(args.run, open_model, args.text or DEFAULT_TEXT, checkpoint=args.checkpoint)
    model, tokenizer = open_model(args.checkpoint)
    text = args.text or DEFAULT_TEXT
    ex = source.explorer(model, tokenizer, text, model_name=str(args.checkpoint))
    ex = source.switchable(ex, model, tokenizer, text, model_name=str(args.checkpoint))  # MHA/GQA/MQA in the page
    if args.sae is not None:
        ex.features_page = features_page(args.sae, args.sae_data, model, tokenizer)
    return ex


def features_page(sae_folder, data, model, tokenizer) -> str:
    """The feature browser of `sae features --html`, for this model's SAE, over `data` (its defaults)."""
    from ..research.sae import browse_ids, feature_report, load_sae
    from ..viewer.features import page

    if data is None:
        raise UserError("--sae needs --sae-data DATA: the text whose top-activating contexts the browser shows")
    sae, meta, site = load_sae(sae_folder, model)  # refuses an SAE of another model, site or width
    report = feature_report(model, sae, site, browse_ids(data, model, tokenizer), tokenizer,
                            context=min(128, model.config.max_seq_len))
    report["sae"], report["evaluation"] = str(sae_folder), meta.get("evaluation")
    return page(report)


def run(args) -> int:
    import sys

    from ..serve.http import is_loopback, keyed_url
    from ..viewer.server import make_server

    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be between 0 and 65535, got {args.port}")
    key, hosts = api_key(args), allowed_hosts(args)  # before the model loads
    explorer = build_explorer(args)
    explorer.payload(explorer.default_text)  # fail now, with a clear message, if the opening sentence cannot be read
    server = make_server(explorer, args.host, args.port, api_key=key, allowed_hosts=hosts,
                         on_ready=lambda url: print(f"explorer at {keyed_url(url + '/', key)}  (Ctrl-C to stop)"
                                                    + (f"\nSAE features at {keyed_url(url + '/features', key)}"
                                                       if explorer.features_page else ""), flush=True))
    if not is_loopback(args.host) and key is None:  # (--insecure-no-key)
        print(f"warning: listening on {args.host} without an API key: anyone who can reach it may use the model",
              file=sys.stderr)
    server.run()  # until Ctrl-C, which stops it cleanly
    print("stopped", file=sys.stderr)
    return 0
