"""Rule-based rewards of the seed papers (SPEC §4, §6.4, §7): host-side pure functions.

Text parsers never raise on model output; they return the score the paper
gives malformed text. Bad caller input (wrong argument types or lengths)
raises `ValueError` naming the argument and the fix. See `docs/rewards.md`.
"""

from agentrl.rewards.answers import (
    answer_in_text,
    as_golds,
    exact_match,
    extract_boxed,
    normalize_answer,
)
from agentrl.rewards.bleu import short_form_bleu, short_form_bleu_tokens
from agentrl.rewards.mt_grpo import (
    mt_grpo_answer_presence_reward,
    mt_grpo_exact_match_reward,
    mt_grpo_outcome_components,
    mt_grpo_outcome_reward,
    mt_grpo_search_answer_reward,
    mt_grpo_tool_execution_reward,
    mt_grpo_turn_components,
    mt_grpo_turn_reward,
    mt_grpo_xml_format_reward,
    mt_grpo_xml_format_score,
    mt_grpo_xml_tag_usage_reward,
    mt_grpo_xml_tag_usage_score,
)
from agentrl.rewards.parsing import (
    TagToken,
    ToolCallParse,
    count_tag,
    extract_tag,
    find_tag_blocks,
    parse_json,
    parse_tool_call_blocks,
    parse_tool_calls,
    tag_tokens,
)
from agentrl.rewards.portool import portool_format_score, portool_format_score_from_flags
from agentrl.rewards.prs import (
    prs_format_reward,
    prs_general,
    prs_long,
    prs_process_from_flags,
    prs_process_reward,
    prs_short,
    prs_short_components,
)
from agentrl.rewards.search import (
    count_searches,
    mt_ppo_final_components,
    mt_ppo_final_format_ok,
    mt_ppo_final_reward,
    mt_ppo_intermediate_components,
    mt_ppo_intermediate_format_ok,
    mt_ppo_intermediate_reward,
    mt_ppo_trajectory_rewards,
)

__all__ = [
    "TagToken",
    "ToolCallParse",
    "answer_in_text",
    "as_golds",
    "count_searches",
    "count_tag",
    "exact_match",
    "extract_boxed",
    "extract_tag",
    "find_tag_blocks",
    "mt_grpo_answer_presence_reward",
    "mt_grpo_exact_match_reward",
    "mt_grpo_outcome_components",
    "mt_grpo_outcome_reward",
    "mt_grpo_search_answer_reward",
    "mt_grpo_tool_execution_reward",
    "mt_grpo_turn_components",
    "mt_grpo_turn_reward",
    "mt_grpo_xml_format_reward",
    "mt_grpo_xml_format_score",
    "mt_grpo_xml_tag_usage_reward",
    "mt_grpo_xml_tag_usage_score",
    "mt_ppo_final_components",
    "mt_ppo_final_format_ok",
    "mt_ppo_final_reward",
    "mt_ppo_intermediate_components",
    "mt_ppo_intermediate_format_ok",
    "mt_ppo_intermediate_reward",
    "mt_ppo_trajectory_rewards",
    "normalize_answer",
    "parse_json",
    "parse_tool_call_blocks",
    "parse_tool_calls",
    "portool_format_score",
    "portool_format_score_from_flags",
    "prs_format_reward",
    "prs_general",
    "prs_long",
    "prs_process_from_flags",
    "prs_process_reward",
    "prs_short",
    "prs_short_components",
    "short_form_bleu",
    "short_form_bleu_tokens",
    "tag_tokens",
]
