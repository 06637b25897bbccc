// The Vercel AI SDK and the OpenAI Agents SDK for JavaScript against longrun, unchanged
// (tests/test_node_sdks.py runs this). Usage: node sdks.mjs BASE_URL CLIENT
// CLIENT: vercel-generate | vercel-stream | agents-http | agents-websocket.
// Prints one JSON line: the tool calls the SDK ran (their `cmd` arguments) and the final text.
import { createOpenAI } from '@ai-sdk/openai';
import { Agent, run, setDefaultOpenAIClient, setOpenAIResponsesTransport, setTracingDisabled, tool as agentTool } from '@openai/agents';
import { generateText, stepCountIs, streamText, tool } from 'ai';
import OpenAI from 'openai';
import WebSocket from 'ws';
import { z } from 'zod';

// Node 22 has a global WebSocket; on older Node the Agents SDK asks for one (`ws` is it).
globalThis.WebSocket ??= WebSocket;

const [baseURL, client] = process.argv.slice(2);
const apiKey = 'sk-longrun';
const prompt = 'Fix the failing test in module 3.';
const calls = [];
const execute = async ({ cmd }) => {
  calls.push(cmd);
  return 'ok';
};
let text;

if (client.startsWith('vercel')) {
  const openai = createOpenAI({ baseURL, apiKey });
  const tools = { exec_command: tool({ description: 'Run a shell command.', inputSchema: z.object({ cmd: z.string() }), execute }) };
  const options = { model: openai.responses('sim'), prompt, tools, stopWhen: stepCountIs(10) };
  if (client === 'vercel-stream') {
    const result = streamText(options);
    text = await result.text;
  } else {
    text = (await generateText(options)).text;
  }
} else {
  setTracingDisabled(true); // the SDK would export traces to api.openai.com
  setDefaultOpenAIClient(new OpenAI({ baseURL, apiKey }));
  setOpenAIResponsesTransport(client === 'agents-websocket' ? 'websocket' : 'http');
  const exec = agentTool({ name: 'exec_command', description: 'Run a shell command.', parameters: z.object({ cmd: z.string() }), execute });
  const agent = new Agent({ name: 'fixer', instructions: 'Fix the test.', tools: [exec], model: 'sim' });
  const result = await run(agent, prompt, { maxTurns: 10 });
  text = result.finalOutput;
}
console.log(JSON.stringify({ calls, text }));
process.exit(0); // a WebSocket the SDK keeps open would hold the process
