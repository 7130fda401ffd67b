"""`glassformer sae`: sparse autoencoders on one site of a model (docs/research.md#sparse-autoencoders).

    sae train     a TopK SAE on the site's activations over --data (resumable, with a progress bar)
    sae features  each feature's top-activating contexts and logit effects, as JSON or a page (--html)
    sae export    SAELens's two files alone, in a new folder

`generate --sae SAE --sae-ablate F --sae-steer F:SCALE` ablates or steers features while it generates.
"""

from __future__ import annotations

import sys

from .options import add_device_argument

HELP = "sparse autoencoders: train a TopK SAE on a site, browse its features, export it for SAELens"


def add_arguments(p) -> None:
    sub = p.add_subparsers(dest="sae_verb", metavar="<action>", required=True, parser_class=type(p))
    t = sub.add_parser("train", help="train a TopK SAE on one site's activations", description="train a TopK SAE on "
                       "one site's activations; writes our folder format, which is also SAELens's (cfg.json + "
                       "sae_weights.safetensors)")
    t.add_argument("--checkpoint", required=True, metavar="CKPT", help="checkpoint or run folder")
    t.add_argument("--site", required=True, metavar="NAME",
                   help="blocks.L.hook_resid_pre / hook_resid_mid / hook_resid_post / hook_attn_out / hook_mlp_out "
                        "(TransformerLens's names), or a probe name such as blocks.1.ffn.act")
    t.add_argument("--data", required=True, metavar="D", help="a UTF-8 text file, or a prepared data folder")
    t.add_argument("--features", required=True, type=int, metavar="N", help="the SAE's width (features)")
    t.add_argument("--k", required=True, type=int, metavar="K", help="features kept per token")
    t.add_argument("--out", required=True, metavar="SAE", help="the SAE folder to write")
    t.add_argument("--tokens", type=int, default=2_000_000, help="training tokens in all (with --resume: the total to reach)")
    t.add_argument("--batch-tokens", type=int, default=4096, help="activations per optimizer step")
    t.add_argument("--context", type=int, default=128, help="tokens per window the model reads")
    t.add_argument("--lr", type=float, default=4e-4, help="Adam's learning rate")
    t.add_argument("--dead-tokens", type=int, default=1_000_000,
                   help="a feature silent for this many training tokens counts as dead and gets the AuxK loss")
    t.add_argument("--eval-tokens", type=int, default=16384, help="held-out activations the final figures are measured on")
    t.add_argument("--seed", type=int, default=0, help="the windows drawn and the initial weights")
    t.add_argument("--resume", action="store_true", help="continue the run in --out up to --tokens")
    t.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_device_argument(t)
    t.add_argument("--json", action="store_true", help="the last stdout line is a JSON summary")

    f = sub.add_parser("features", help="each feature's top-activating contexts and its effect on the logits",
                       description="each feature's top-activating contexts in --data, with the feature's activation "
                                   "on every token, and its decoder row's effect on the logits")
    f.add_argument("--checkpoint", required=True, metavar="CKPT", help="the checkpoint the SAE was trained on")
    f.add_argument("--sae", required=True, metavar="SAE", help="an SAE folder from `sae train`")
    f.add_argument("--data", required=True, metavar="D", help="a UTF-8 text file, or a prepared data folder (its val split)")
    f.add_argument("--tokens", type=int, default=32768, help="tokens of --data to read")
    f.add_argument("--context", type=int, default=128, help="tokens per window the model reads")
    f.add_argument("--top", type=int, default=8, help="contexts per feature")
    f.add_argument("--window", type=int, default=8, help="tokens shown each side of the activating one")
    f.add_argument("--feature", type=int, action="append", default=None, metavar="F",
                   help="only this feature (repeatable); default: the --max-features that fire most often")
    f.add_argument("--max-features", type=int, default=256, help="features listed without --feature")
    f.add_argument("--html", metavar="FILE", default=None, help="also write the feature browser as one page (.html)")
    add_device_argument(f)
    f.add_argument("--json", action="store_true", help="the last stdout line is the whole report as JSON")

    e = sub.add_parser("export", help="SAELens's files (cfg.json, sae_weights.safetensors) alone in a new folder",
                       description="copy SAELens's two files of an SAE folder into a new folder (for "
                                   "SAE.load_from_disk or a Hub upload); the SAE folder itself loads there too")
    e.add_argument("--sae", required=True, metavar="SAE", help="an SAE folder from `sae train`")
    e.add_argument("--out", required=True, metavar="DIR", help="the new folder")
    e.add_argument("--json", action="store_true", help="the last stdout line is a JSON summary")


def add_generate_arguments(p) -> None:
    """generate's --sae, --sae-ablate and --sae-steer; sae_edit applies them."""
    p.add_argument("--sae", metavar="SAE", default=None, help="an SAE folder (from `glassformer sae train`) whose "
                   "features --sae-ablate and --sae-steer name")
    p.add_argument("--sae-ablate", type=int, action="append", default=[], metavar="F",
                   help="take feature F's contribution out of the SAE's site at every position (repeatable)")
    p.add_argument("--sae-steer", action="append", default=[], metavar="F:SCALE",
                   help="add SCALE times feature F's decoder direction at the SAE's site (repeatable)")


def check_sae_flags(args) -> None:
    """generate's SAE flags checked, and the SAE folder's sae.json read, before any model is loaded."""
    from ..errors import UserError
    from ..research.sae import parse_steer, read_meta

    if getattr(args, "sae", None) is None:
        if getattr(args, "sae_ablate", None) or getattr(args, "sae_steer", None):
            raise UserError("--sae-ablate and --sae-steer name features of an SAE: give --sae SAE")
        return
    for s in args.sae_steer:
        parse_steer(s)
    if not (args.sae_ablate or args.sae_steer):
        raise UserError("--sae does nothing alone: add --sae-ablate F or --sae-steer F:SCALE")
    read_meta(args.sae)


def sae_edit(args, model):
    """The FeatureEdit generate's SAE flags ask for (forward hooks on `model` from now on), or None without --sae."""
    from ..research.sae import FeatureEdit, load_sae, parse_steer

    if getattr(args, "sae", None) is None:
        return None
    sae, _, site = load_sae(args.sae, model, device=next(model.parameters()).device)
    return FeatureEdit(model, sae, site, ablate=args.sae_ablate, steer=[parse_steer(s) for s in args.sae_steer])


def _load(args):
    from ..checkpoint.loading import load
    from ..devices import resolve_device

    resolve_device(args.device)
    return load(args.checkpoint, device=args.device)


def _train(args) -> int:
    import json

    from ..errors import UserError
    from ..research.sae import TrainSettings, Trainer, data_ids, resolve_site

    if args.resume and not args.out:
        raise UserError("--resume continues the run in --out: give --out")
    model, tok = _load(args)
    site = resolve_site(model, args.site)
    settings = TrainSettings(features=args.features, k=args.k, tokens=args.tokens, batch_tokens=args.batch_tokens,
                             context=args.context, lr=args.lr, dead_tokens=args.dead_tokens,
                             eval_tokens=args.eval_tokens, seed=args.seed)
    from ..research.sae import check_settings

    check_settings(settings, model.config.max_seq_len)  # before the data is read
    train_ids, eval_ids = data_ids(args.data, model, tok)
    trainer = Trainer(model, site, train_ids, eval_ids, settings, args.out, model_name=str(args.checkpoint),
                      device=args.device, resume=args.resume)
    r = trainer.train(progress=not args.no_progress)
    print(f"wrote {args.out}: {r['d_sae']} features (k {r['k']}) on {r['site']} (probe {r['probe']}, width "
          f"{r['d_in']}); {r['tokens']:,} tokens in {r['steps']} steps, {r['tokens_per_s']:,.0f} tokens/s; on "
          f"{r['eval_tokens']:,} held-out tokens: explained variance {r['explained_variance']:.4f}, L0 {r['l0']:.2f}, "
          f"dead features {r['dead_features']} ({r['dead_fraction']:.1%})")
    if args.json:
        print(json.dumps({"out": str(args.out), **r}))
    return 0


def _features(args) -> int:
    import json

    from ..errors import UserError
    from ..research.sae import browse_ids, feature_report, load_sae

    for flag, v in (("--tokens", args.tokens), ("--context", args.context), ("--top", args.top),
                    ("--max-features", args.max_features)):
        if v < 1:
            raise UserError(f"{flag} must be >= 1, got {v}")
    if args.window < 0:
        raise UserError(f"--window must be >= 0, got {args.window}")
    if args.html is not None:
        from .options import check_output_file

        if not args.html.lower().endswith((".html", ".htm")):
            raise UserError(f"--html writes a page: give a file name ending in .html, got {args.html!r}")
        check_output_file("--html", args.html)
    model, tok = _load(args)
    if args.context > model.config.max_seq_len:
        raise UserError(f"--context {args.context} is longer than the model's {model.config.max_seq_len} tokens")
    sae, meta, site = load_sae(args.sae, model, device=args.device)
    ids = browse_ids(args.data, model, tok)
    rep = feature_report(model, sae, site, ids, tok, n_tokens=args.tokens, context=args.context, top=args.top,
                         window=args.window, features=args.feature, max_features=args.max_features)
    rep["sae"], rep["evaluation"] = str(args.sae), meta.get("evaluation")
    for f in rep["features"][:10]:
        best = f["contexts"][0] if f["contexts"] else None
        shown = "" if best is None else "".join(best["tokens"]).replace("\n", "⏎")
        print(f"feature {f['id']:>6}: fires on {f['frequency']:.2%} of tokens, max {f['max']:.3g}; top: {shown!r}")
    if args.html is not None:
        from ..viewer.features import write_page

        path = write_page(args.html, rep)
        print(f"wrote {path}: {len(rep['features'])} features; open it in a browser", file=sys.stderr)
    if args.json:
        print(json.dumps(rep))
    return 0


def _export(args) -> int:
    import json

    from ..research.sae import export_saelens

    out = export_saelens(args.sae, args.out)
    print(f"wrote {out}: cfg.json and sae_weights.safetensors (SAELens's 'topk' architecture; "
          f"sae_lens.SAE.load_from_disk({str(out)!r}))")
    if args.json:
        print(json.dumps({"out": str(out), "files": ["cfg.json", "sae_weights.safetensors"]}))
    return 0


def run(args) -> int:
    return {"train": _train, "features": _features, "export": _export}[args.sae_verb](args)
