"""Version guard: the vLLM code the adapter relies on, fingerprinted per tested release.

kvcore does not replace vLLM functions in place; it subclasses vLLM's CPU offloading spec
and manager and puts the subclass where vLLM's spec factory looks for the default spec,
and swaps the worker's transfer handler objects for its own. The subclasses override some
methods and rely on what others do with the state they share, and the handler reads the
stock one's state and calls its descriptor fill, so each of those methods is a target.
Fingerprints (:mod:`kvcore.fingerprint`) are read from the installed files without
importing vLLM: `kvcore doctor` and the plugin reach the same verdict, and the doctor
stays fast.

Targets are named as vLLM 0.33 names them; :mod:`kvcore_vllm.releases` maps them to
each release's names and leaves out the fill methods of a release that fills inline.
Only the standard library and kvcore's core are imported here.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from kvcore import fingerprint
from kvcore_vllm.releases import shape_of

ENGINE = "vllm"
DISTRIBUTION = "vllm"


@dataclass(frozen=True)
class Target:
    """One function of vLLM that the adapter overrides (in a subclass) or depends on."""

    module: str
    qualname: str
    overridden: bool = False
    fill: bool = False
    """A descriptor fill method: releases that fill inside transfer_async have none."""

    @property
    def name(self) -> str:
        return f"{self.module}.{self.qualname}"


_MANAGER = "vllm.v1.kv_offload.cpu.manager"
_SPEC = "vllm.v1.kv_offload.cpu.spec"
_FACTORY = "vllm.v1.kv_offload.factory"
_WORKER = "vllm.v1.kv_offload.cpu.gpu_worker"
_POLICIES = "vllm.v1.kv_offload.cpu.policies.base"

# Overridden: the chunk pool methods and get_manager. Depended on: the manager's
# constructor and the methods that call the chunk pool or read its counters, and the
# factory methods that resolve the default spec name through the registry.
TARGETS: tuple[Target, ...] = (
    Target(_MANAGER, "CPUOffloadingManager.__init__"),
    Target(_MANAGER, "CPUOffloadingManager._get_num_free_chunks", overridden=True),
    Target(_MANAGER, "CPUOffloadingManager._allocate_chunks", overridden=True),
    Target(_MANAGER, "CPUOffloadingManager._free_chunk", overridden=True),
    Target(_MANAGER, "CPUOffloadingManager.prepare_store"),
    Target(_MANAGER, "CPUOffloadingManager.complete_store"),
    Target(_MANAGER, "CPUOffloadingManager.reset_cache", overridden=True),
    Target(_MANAGER, "CPUOffloadingManager.get_stats"),
    # kvcore's chunk pool builds the manager's chunk records itself.
    Target(_POLICIES, "ChunkStatus.__init__"),
    Target(_SPEC, "CPUOffloadingSpec.get_manager", overridden=True),
    Target(_FACTORY, "OffloadingSpecFactory.register_spec"),
    Target(_FACTORY, "OffloadingSpecFactory.get_spec_cls"),
    Target(_FACTORY, "OffloadingSpecFactory.create_spec"),
    # The worker's transfer handlers are replaced after the stock create_worker built
    # them: kvcore's handler reads the stock one's state, keeps its contract, pairs pages
    # as its transfer_async and sub-block pointers do, and hands the jobs it does not copy
    # to the stock handler (transfer_async, get_finished, wait, shutdown). The A/B bench
    # issues stock's descriptors through the fill __init__ binds as _fill_group_ops (0.25
    # fills inline, through compute_sub_block_ptrs); the handler tells the copy op that
    # _select_swap_blocks_fn picks apart (a partial for the Triton load kernel).
    Target(_SPEC, "CPUOffloadingSpec.create_worker", overridden=True),
    Target(_WORKER, "CPUOffloadingWorker.__init__"),
    Target(_WORKER, "CPUOffloadingWorker.submit_store"),
    Target(_WORKER, "CPUOffloadingWorker.submit_load"),
    Target(_WORKER, "CPUOffloadingWorker.get_finished"),
    Target(_WORKER, "CPUOffloadingWorker.wait"),
    Target(_WORKER, "CPUOffloadingWorker.shutdown"),
    Target(_WORKER, "SingleDirectionOffloadingHandler.__init__"),
    Target(_WORKER, "SingleDirectionOffloadingHandler._estimate_max_copy_ops", fill=True),
    Target(_WORKER, "SingleDirectionOffloadingHandler._fill_direct_ops", fill=True),
    Target(_WORKER, "SingleDirectionOffloadingHandler._fill_canonical_ops", fill=True),
    Target(_WORKER, "SingleDirectionOffloadingHandler.transfer_async"),
    Target(_WORKER, "SingleDirectionOffloadingHandler.get_finished"),
    Target(_WORKER, "SingleDirectionOffloadingHandler.wait"),
    Target(_WORKER, "SingleDirectionOffloadingHandler.shutdown"),
    Target(_WORKER, "compute_sub_block_ptrs"),
    Target(_WORKER, "_select_swap_blocks_fn"),
)

# Release -> target qualname (in the release's names) -> fingerprint. Print a release's
# with ``python -c 'import kvcore_vllm.guard as g; g.main()' RELEASE [ROOT]`` (the
# installed vLLM by default).
FINGERPRINTS: dict[str, dict[str, str]] = {
    "0.25.1": {
        "CPUOffloadingManager.__init__": (
            "9e897b812c23c878ecea651c81eda9e42d3b4d50e2e4512030d4f8134ac55a5b"
        ),
        "CPUOffloadingManager._get_num_free_blocks": (
            "619526b9a69cede8131754a8fea55c197c9a710a1053a948495461ebf34bf3ec"
        ),
        "CPUOffloadingManager._allocate_blocks": (
            "85f8d69d2b78418b26ffbda2fe52eb77604648b9380ae9143af77f355dbec748"
        ),
        "CPUOffloadingManager._free_block": (
            "dd4ba397955819af29148e47c2a3974ac907e627a908b02de6a5a3f2a6cb1c0e"
        ),
        "CPUOffloadingManager.prepare_store": (
            "838e8f6c4a5030aa7908e36752663fe35218c3081631e43fc33c427264e50123"
        ),
        "CPUOffloadingManager.complete_store": (
            "69fb9c320f57ce16ef9f0de6de57361042b98602db9a09e8592be6beb40e114a"
        ),
        "CPUOffloadingManager.reset_cache": (
            "315205727c39ab603d23c89cbb0ead93448d581825f5166fd2948980ab2663c2"
        ),
        "CPUOffloadingManager.get_stats": (
            "a7adab731a6e6c50108a3cd1a8544ac74cc03e58939db0ce9f14783947a813fe"
        ),
        "BlockStatus.__init__": (
            "ec7cc108ce2a55db9d2da7fc05fb947cef45d7023e1f271205e967caa5df57e1"
        ),
        "CPUOffloadingSpec.get_manager": (
            "5518a399486c2e4fcca3b1e57a76f331c283e22af8f4dc0f99dc197d30516a3e"
        ),
        "OffloadingSpecFactory.register_spec": (
            "642a5f8c7bdc13581886f8af0657236f692c560c1cc2b875c00f8514f6afed24"
        ),
        "OffloadingSpecFactory.get_spec_cls": (
            "6d1300f0ee74f3e478516d7b954e95d6f7c03d382a3fc633d14b4bd1b941a49d"
        ),
        "OffloadingSpecFactory.create_spec": (
            "907e37b7bbd67cd8d15c2517b5529bd88e7c0b05254198ca5bc53204aa080374"
        ),
        "CPUOffloadingSpec.create_worker": (
            "7b5744c1cb8c9e938ccaf52c32ecf558efeed21ef3c23d3cca245eb7820bb310"
        ),
        "CPUOffloadingWorker.__init__": (
            "f64f2775657b10422eba93bd4ddff27d4af49687260159426e5a1e135128d19e"
        ),
        "CPUOffloadingWorker.submit_store": (
            "bca152246abc88b8c9929533bff23bc70a4c0c88718ac963d073ddc24ce39dc1"
        ),
        "CPUOffloadingWorker.submit_load": (
            "91eb8d4890e4949ef434a58da4383096a42c3316102412d648d96aa916661ebd"
        ),
        "CPUOffloadingWorker.get_finished": (
            "1015445ffd9699c1066c5cd266965553b25494277d4a379a134fb49a2925f29d"
        ),
        "CPUOffloadingWorker.wait": (
            "d35d0b09e7bf1302d70b9689e2755decf47123c2163ba6e392dc8f15c181a367"
        ),
        "CPUOffloadingWorker.shutdown": (
            "e81eb0550dea6ce95039c3b4df6fc5034bf8d06d4952f18f06d765f00e532b62"
        ),
        "SingleDirectionOffloadingHandler.__init__": (
            "1c9661781cf2280ff513927f2c1f87a62ce242b6b581523dee497fd3eccd778c"
        ),
        "SingleDirectionOffloadingHandler.transfer_async": (
            "bcee10009a87087b3905bfbc586649cedd760207b0f381a09afd0f3b51c66e02"
        ),
        "SingleDirectionOffloadingHandler.get_finished": (
            "aef518bd77a2086b48145951a113ea6dda5ce9cacc46c04d5536f56aaea28c89"
        ),
        "SingleDirectionOffloadingHandler.wait": (
            "eadca0aea61d8d9c1f618aafbda9ee5faf3ec39de99abfc8e206176bbe26d2f7"
        ),
        "SingleDirectionOffloadingHandler.shutdown": (
            "b7123582eae6924e6c53eebb768a5e3e57852b9927507473b18ac76b69c0119f"
        ),
        "compute_sub_block_ptrs": (
            "b9b4d457907c1f751b88ca732273754733e3baf02c47991dacea4cbbbb2ba003"
        ),
        "_select_swap_blocks_fn": (
            "9254683c5f1e6f412eaa9d0931e72be3317427921d9f71e2f4038619fdf649f1"
        ),
    },
    "0.32.0": {
        "CPUOffloadingManager.__init__": (
            "a3a22ab7b74be693ac3309c643eedc8fb760981c75540cf6c450d3f9f8f74143"
        ),
        "CPUOffloadingManager._get_num_free_chunks": (
            "97cc88d90cb9d4eefa188cdac8a6f30b5fa6caac6b71894938b06b91c7528235"
        ),
        "CPUOffloadingManager._allocate_chunks": (
            "915c2ab59bef1a4ca6411eca5e617117430aa5b63c86f410421c86b59e8f6306"
        ),
        "CPUOffloadingManager._free_chunk": (
            "f86ec4a8ba3483f7a65962fbc46af88e2720a91ce15f70124f11105a8811b1be"
        ),
        "CPUOffloadingManager.prepare_store": (
            "de70f87a8d28630041033b46321e9321e267436d01dcf610a659c234001c7a82"
        ),
        "CPUOffloadingManager.complete_store": (
            "30330e2fb44fe8331c377d88336b64e8711f4307fe70ca232741730a60b5d67c"
        ),
        "CPUOffloadingManager.reset_cache": (
            "6fe4b3ce0dc1d8b5945aa407f3694bd3c9dfcbb68a9153a81f078180daa6f65d"
        ),
        "CPUOffloadingManager.get_stats": (
            "ac57f67a8be934fd5234062ca26ada612c6fddc3688032649c9e50fca9f513e3"
        ),
        "ChunkStatus.__init__": (
            "a9ea94710746de291ad44a99da412676e3156be6f02fbc80582ad9f1312e1295"
        ),
        "CPUOffloadingSpec.get_manager": (
            "c1c63043f12c09d0fbc58d6333ceb9b18eb441777e0464c392e982440c98b004"
        ),
        "OffloadingSpecFactory.register_spec": (
            "642a5f8c7bdc13581886f8af0657236f692c560c1cc2b875c00f8514f6afed24"
        ),
        "OffloadingSpecFactory.get_spec_cls": (
            "543b3ec08f58eecf5401afcceb466100ecb962afde90be0279c2302045361877"
        ),
        "OffloadingSpecFactory.create_spec": (
            "4acbcf9f29ba2a93e8fdd2bea7f0a24ac06dbb47b604f00da9f4c852191cc89e"
        ),
        "CPUOffloadingSpec.create_worker": (
            "27631d6925e93ebea08bc74398b4dfadc33a2f44e873ac6575fa03dd52f9786d"
        ),
        "CPUOffloadingWorker.__init__": (
            "5ada72feb2b0c45ef96312941c14ebb395a61d9f190d8095ca7c0dd9f9fa8315"
        ),
        "CPUOffloadingWorker.submit_store": (
            "bca152246abc88b8c9929533bff23bc70a4c0c88718ac963d073ddc24ce39dc1"
        ),
        "CPUOffloadingWorker.submit_load": (
            "91eb8d4890e4949ef434a58da4383096a42c3316102412d648d96aa916661ebd"
        ),
        "CPUOffloadingWorker.get_finished": (
            "1015445ffd9699c1066c5cd266965553b25494277d4a379a134fb49a2925f29d"
        ),
        "CPUOffloadingWorker.wait": (
            "d35d0b09e7bf1302d70b9689e2755decf47123c2163ba6e392dc8f15c181a367"
        ),
        "CPUOffloadingWorker.shutdown": (
            "e50a18a9f12a0fe3adbb3268433134ecf4c98bafa673c220e8f361c134a05632"
        ),
        "SingleDirectionOffloadingHandler.__init__": (
            "c5a085777b125ea6442c2c0dd5a38429b0986c468adb729e517cee28923cdfa9"
        ),
        "SingleDirectionOffloadingHandler._estimate_max_copy_ops": (
            "90b43abc9d635603499470598e4c5d3031bd341243e722c4c761a90f3d7f06a4"
        ),
        "SingleDirectionOffloadingHandler._fill_direct_ops": (
            "cbe601d6d4821b499e09b44b02d5e2619c5e03605e15124017bd57520caced4e"
        ),
        "SingleDirectionOffloadingHandler._fill_canonical_ops": (
            "6ca705a9a9688467d9d05ea9815f09ce109abab61250701681321bb2b39dc595"
        ),
        "SingleDirectionOffloadingHandler.transfer_async": (
            "0959ee8fc08b3599a9cb01903b83898a53defac8e4afc74a160b9c3f319f9295"
        ),
        "SingleDirectionOffloadingHandler.get_finished": (
            "aef518bd77a2086b48145951a113ea6dda5ce9cacc46c04d5536f56aaea28c89"
        ),
        "SingleDirectionOffloadingHandler.wait": (
            "eadca0aea61d8d9c1f618aafbda9ee5faf3ec39de99abfc8e206176bbe26d2f7"
        ),
        "SingleDirectionOffloadingHandler.shutdown": (
            "96b0194e66b6ce80178bb9744c954de11f3f40a8c18b6533d4a3379091bebb98"
        ),
        "compute_sub_block_ptrs": (
            "73aa8343f47860ad247b134a672ec67977895991bcc6c421298e7f397ebe6de9"
        ),
        "_select_swap_blocks_fn": (
            "4c75ad718cd29c2bac6546041681db82e5fdda38d5c22eda32ba2af2a8c75974"
        ),
    },
    "0.33.0": {
        "CPUOffloadingManager.__init__": (
            "fae5629dc305e82189a6cb962a41589e75d95361807218eb4b6832e7e47a6ee5"
        ),
        "CPUOffloadingManager._get_num_free_chunks": (
            "97cc88d90cb9d4eefa188cdac8a6f30b5fa6caac6b71894938b06b91c7528235"
        ),
        "CPUOffloadingManager._allocate_chunks": (
            "915c2ab59bef1a4ca6411eca5e617117430aa5b63c86f410421c86b59e8f6306"
        ),
        "CPUOffloadingManager._free_chunk": (
            "f86ec4a8ba3483f7a65962fbc46af88e2720a91ce15f70124f11105a8811b1be"
        ),
        "CPUOffloadingManager.prepare_store": (
            "5670b769d8bd7d63be1d22361f5f6e2388e371f3dd12c4cbde50481eff5bf017"
        ),
        "CPUOffloadingManager.complete_store": (
            "86458465ea2a1ccfb444ea5a5a12e95bd92fe5a590df53aa9130f56bb8b609b4"
        ),
        "CPUOffloadingManager.reset_cache": (
            "6fe4b3ce0dc1d8b5945aa407f3694bd3c9dfcbb68a9153a81f078180daa6f65d"
        ),
        "CPUOffloadingManager.get_stats": (
            "ac57f67a8be934fd5234062ca26ada612c6fddc3688032649c9e50fca9f513e3"
        ),
        "ChunkStatus.__init__": (
            "a9ea94710746de291ad44a99da412676e3156be6f02fbc80582ad9f1312e1295"
        ),
        "CPUOffloadingSpec.get_manager": (
            "87ee981dcf7e3f996f0a4bcc88feb83a32b396f02668e822d6e8f74255ceb5e3"
        ),
        "OffloadingSpecFactory.register_spec": (
            "642a5f8c7bdc13581886f8af0657236f692c560c1cc2b875c00f8514f6afed24"
        ),
        "OffloadingSpecFactory.get_spec_cls": (
            "543b3ec08f58eecf5401afcceb466100ecb962afde90be0279c2302045361877"
        ),
        "OffloadingSpecFactory.create_spec": (
            "4acbcf9f29ba2a93e8fdd2bea7f0a24ac06dbb47b604f00da9f4c852191cc89e"
        ),
        "CPUOffloadingSpec.create_worker": (
            "1e650a6ad14e50f7b4eff460764d2c8687d77cd94801e9afa824a46f780cd7d1"
        ),
        "CPUOffloadingWorker.__init__": (
            "5dba46e006fd89acc690e590d5e9555a90bea426191792e9a989e791a7c10212"
        ),
        "CPUOffloadingWorker.submit_store": (
            "bca152246abc88b8c9929533bff23bc70a4c0c88718ac963d073ddc24ce39dc1"
        ),
        "CPUOffloadingWorker.submit_load": (
            "408a4fd15670aa439411f54f385eb4aeea1c34aaa966b14531ea931abd64e5d1"
        ),
        "CPUOffloadingWorker.get_finished": (
            "706c4be4f2da6089c901b4ad5ecd63bf0ec14f3ea621daec0c6f65435d6b58eb"
        ),
        "CPUOffloadingWorker.wait": (
            "7732f9984eaa7e6d4e77821735799ed297adddcca91cad24828e1441ec431add"
        ),
        "CPUOffloadingWorker.shutdown": (
            "8bb918cb90265e4f3d7139f64b73df49459a546ca0b76fa8ccf3cfd04e79f347"
        ),
        "SingleDirectionOffloadingHandler.__init__": (
            "c5a085777b125ea6442c2c0dd5a38429b0986c468adb729e517cee28923cdfa9"
        ),
        "SingleDirectionOffloadingHandler._estimate_max_copy_ops": (
            "90b43abc9d635603499470598e4c5d3031bd341243e722c4c761a90f3d7f06a4"
        ),
        "SingleDirectionOffloadingHandler._fill_direct_ops": (
            "cbe601d6d4821b499e09b44b02d5e2619c5e03605e15124017bd57520caced4e"
        ),
        "SingleDirectionOffloadingHandler._fill_canonical_ops": (
            "6ca705a9a9688467d9d05ea9815f09ce109abab61250701681321bb2b39dc595"
        ),
        "SingleDirectionOffloadingHandler.transfer_async": (
            "0959ee8fc08b3599a9cb01903b83898a53defac8e4afc74a160b9c3f319f9295"
        ),
        "SingleDirectionOffloadingHandler.get_finished": (
            "aef518bd77a2086b48145951a113ea6dda5ce9cacc46c04d5536f56aaea28c89"
        ),
        "SingleDirectionOffloadingHandler.wait": (
            "eadca0aea61d8d9c1f618aafbda9ee5faf3ec39de99abfc8e206176bbe26d2f7"
        ),
        "SingleDirectionOffloadingHandler.shutdown": (
            "96b0194e66b6ce80178bb9744c954de11f3f40a8c18b6533d4a3379091bebb98"
        ),
        "compute_sub_block_ptrs": (
            "73aa8343f47860ad247b134a672ec67977895991bcc6c421298e7f397ebe6de9"
        ),
        "_select_swap_blocks_fn": (
            "4c75ad718cd29c2bac6546041681db82e5fdda38d5c22eda32ba2af2a8c75974"
        ),
    },
}
# The tested releases are exactly those with fingerprints.
SUPPORTED_VERSIONS: tuple[str, ...] = tuple(FINGERPRINTS)


def targets_for(release: str) -> tuple[Target, ...]:
    """The targets as ``release`` names them, without the fill methods it lacks."""
    shape = shape_of(release)
    return tuple(
        replace(t, qualname=shape.qualname(t.qualname))
        for t in TARGETS
        if not (t.fill and shape.fills_in_transfer_async)
    )


def current_fingerprints(release: str, root: Path | None = None) -> dict[str, str]:
    """Target qualname -> fingerprint, as ``release`` names its targets, for the installed
    vLLM (or the tree at ``root``)."""
    return {t.qualname: fingerprint.fingerprint_target(t.name, root) for t in targets_for(release)}


def refusals(
    version: str,
    fingerprints: Mapping[str, Mapping[str, str]] = FINGERPRINTS,
    root: Path | None = None,
) -> dict[str, str]:
    """Target name -> why it cannot be trusted on ``version`` (a release string) in the
    source tree ``root`` (the installed vLLM's by default); empty when every target
    matches the fingerprint recorded for that release."""
    recorded = fingerprints.get(version)
    if recorded is None:
        return {target.name: f"no fingerprints recorded for vLLM {version}" for target in TARGETS}
    targets = targets_for(version)
    by_name = {t.name: recorded[t.qualname] for t in targets if t.qualname in recorded}
    return fingerprint.drift(by_name, root, targets=(t.name for t in targets))


def main(argv: list[str] | None = None) -> None:
    """Print the fingerprints of a release's files as the body of its FINGERPRINTS entry:
    ``RELEASE [ROOT]``, ``ROOT`` the directory that holds the ``vllm`` package (the
    installed one by default); the release decides the targets' names."""
    args = sys.argv[1:] if argv is None else argv
    if not args:
        raise SystemExit("usage: kvcore_vllm.guard.main RELEASE [ROOT]")
    root = Path(args[1]) if len(args) > 1 else None
    for name, value in current_fingerprints(args[0], root).items():
        print(f'        "{name}": (\n            "{value}"\n        ),')


if __name__ == "__main__":
    main()
