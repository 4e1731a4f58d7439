"""``--url``: the scenarios against servers already running (tokenmill's, vLLM's, ...), not started here.

One URL: each workload is measured once on that server. Two URLs: the first is taken as the feature off
and the second as on (say, two vLLM servers started with and without ``--enable-prefix-caching``), so
one workload is compared between them; which feature differs is up to whoever started the servers.
Prompts are built with the first server's ``/tokenize``, so they are corpus text as that model reads it.
"""

import argparse
from collections.abc import Sequence

from tokenmill.benchmarks.report import client_machine, report_dir
from tokenmill.benchmarks.scenarios import http_driver
from tokenmill.benchmarks.scenarios.features import TOGGLES
from tokenmill.benchmarks.scenarios.report import MeasuredConfig, WorkloadResult, section
from tokenmill.benchmarks.scenarios.results import finish, header_lines
from tokenmill.benchmarks.scenarios.sizes import preset_name, sizes_for
from tokenmill.benchmarks.scenarios.workloads import build_scenario, token_source

MAX_SERVERS = 2


def run_against_servers(args: argparse.Namespace, names: Sequence[str], started: float) -> int:
    urls = [url.rstrip("/").removesuffix("/v1") for url in args.url]
    _check_servers(args, urls, names)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    model = args.model or http_driver.resolve_served_model(urls[0], headers, args.timeout)
    tokenizer = http_driver.RemoteTokenizer(urls[0], model, headers, args.timeout)
    sizes = sizes_for(args, None)
    source = token_source("text", tokenizer, 0)
    header = _header(args, urls, model)
    machine = f"client {client_machine()}; the servers' hardware is not known to the client"
    print(f"hardware: {machine}\n" + "\n".join(header), flush=True)
    compared = len(urls) == MAX_SERVERS
    labels = ["off", "on"] if compared else ["server"]
    results = []
    for name in names:
        scenario = build_scenario(name, sizes, source, args.seed)
        measured = [
            MeasuredConfig(
                f"{label}: {url}",
                None,
                http_driver.measure_url(url, model, headers, scenario, args.timeout, not args.no_progress),
            )
            for label, url in zip(labels, urls, strict=True)
        ]
        change = f"{urls[0]} (off) vs {urls[1]} (on), as they were started" if compared else urls[0]
        results.append(WorkloadResult(scenario, TOGGLES[name].name if compared else None, change, measured))
        print("\n" + section(results[-1]), flush=True)
    folder = report_dir(args.report_dir, "scenarios-url")
    meta = {"driver": "serve", "urls": urls, "sizes": sizes.__dict__}
    return finish(results, header, folder, started, meta, machine)


def _check_servers(args: argparse.Namespace, urls: Sequence[str], names: Sequence[str]) -> None:
    if len(urls) > MAX_SERVERS:
        raise ValueError(f"--url is given {len(urls)} times; at most {MAX_SERVERS} (feature off, then on)")
    if len(urls) == MAX_SERVERS and len(names) > 1:
        raise ValueError("two --url servers differ in one feature: pick the --workload that shows it")
    if args.prompt_source == "random":
        raise ValueError("with --url, prompts are corpus text tokenized by the server (not random ids)")


def _header(args: argparse.Namespace, urls: Sequence[str], model: str) -> list[str]:
    driver = f"serve: servers already running at {', '.join(urls)}, driven by bench serve's streaming client"
    baseline = (
        f"the first server ({urls[0]}) as the feature off, measured in the same run just before the second"
        if len(urls) == MAX_SERVERS
        else "none: one server, measured alone (give --url twice, feature off then on, to compare)"
    )
    model_text = f"'{model}' as the server names it"
    return header_lines(args, driver, model_text, preset_name(args, None), baseline)
